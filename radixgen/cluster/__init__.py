"""Several engine replicas behind one OpenAI-compatible front: routing, simulation, Ray Serve."""
