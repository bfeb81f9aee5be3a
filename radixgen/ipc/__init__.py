"""The channel between the fronts (the HTTP server, the DSL's remote backend, the cluster) and the
engines they drive, importing neither FastAPI nor torch: ``handle.py`` is the contract every
engine host implements (``EngineHandle``, ``OutputSink``), ``client.py`` one engine in a child
process behind it, ``process.py`` that process's side, ``launch.py`` a whole server started as a
child process (benchmarks, tests)."""
