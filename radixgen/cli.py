"""`radixgen` command line. Engine flags are generated from EngineConfig's fields, so their
defaults are the dataclass defaults and a new config field is a new flag without more code."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from radixgen.config import EngineConfig, ServerConfig


def _flag_type(annotation: Any) -> tuple[Any, Sequence[Any] | None]:
    """argparse type and choices for a dataclass field annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return str, args
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _flag_type(inner[0]) if len(inner) == 1 else (str, None)
    if annotation in (int, float, str):
        return annotation, None
    return str, None


# The option groups of --help, in order; a field named in none goes to the last ("other").
_GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model", "dtype", "weights", "device", "seed"),
    "memory": ("max_context_len", "kv_cache_tokens", "kv_cache_gb", "mem_fraction", "disable_radix_cache"),
    "scheduling": ("max_running_requests", "max_prefill_tokens", "chunked_prefill_size", "max_mixed_prefill_tokens",
                   "mixed_steps", "prefill_alone_below_tokens", "max_queued_requests", "schedule_policy", "overlap",
                   "max_new_tokens_limit"),
    "constraints": ("grammar_backend", "json_open_objects", "json_max_recursion_depth", "grammar_compile_timeout_s",
                    "max_schema_bytes", "max_schema_depth", "jump_forward", "jump_forward_max_batch",
                    "json_repeated_items", "budget_steering", "budget_margin_tokens", "tool_call_decision",
                    "tool_call_threshold"),
    "speculation": ("speculative", "speculative_max_draft", "speculative_max_batch", "speculative_step_budget",
                    "speculative_ngram_max"),
    "kernels": ("num_threads", "attention_backend", "small_linear_max_tokens", "tune_kernels", "cuda_graphs",
                "cuda_graph_max_batch"),
    "server": ("host", "port", "served_model_name", "api_key", "max_request_bytes", "max_n", "shutdown_timeout",
               "engine_address", "engine_restarts", "event_log", "log_level"),
    "scale-out": ("replicas", "ray_address", "routing"),
}


def field_docs(config_cls: type) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal after it in the class body), for
    this class and its bases: the one source of an option's explanation."""
    import ast
    import inspect
    import itertools
    import textwrap

    docs: dict[str, str] = {}
    for cls in reversed(config_cls.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):  # no source shipped (a bytecode-only install): flags without help
            continue
        body = ast.parse(textwrap.dedent(source)).body[0]
        assert isinstance(body, ast.ClassDef)
        for node, after in itertools.pairwise(body.body):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _help(doc: str, default: Any) -> str:
    """The docstring's first sentence and the default (None: the docstring says what it means).
    argparse formats help with %-style, so a literal % is doubled."""
    sentence = doc.split(". ")[0].rstrip(".") + "." if doc else ""
    shown = "" if default is None else f" (default: {default})"
    return (sentence + shown).strip().replace("%", "%%")


PRECEDENCE = ("Precedence: a flag given on the command line, else the environment variable an option names "
              "(RADIXGEN_API_KEY for --api-key), else the default shown.")


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type[EngineConfig] = EngineConfig) -> None:
    """One flag per config field, in groups, each with its docstring's first sentence as help
    (``PRECEDENCE`` says which value wins). A ``disable_x`` field is the positive ``--x /
    --no-x``; ``--disable-x`` stays accepted, unlisted."""
    hints = typing.get_type_hints(config_cls)
    docs = field_docs(config_cls)
    parser.epilog = parser.epilog or PRECEDENCE
    groups = {name: parser.add_argument_group(f"{name} options") for name in _GROUPS}
    other = parser.add_argument_group("other options")
    for f in dataclasses.fields(config_cls):
        group = next((groups[g] for g, names in _GROUPS.items() if f.name in names), other)
        flag = "--" + f.name.replace("_", "-")
        annotation = hints[f.name]
        text = _help(docs.get(f.name, ""), f.default)
        if f.name.startswith("disable_") and annotation is bool:  # --x / --no-x, stored negated
            positive = f.name.removeprefix("disable_")
            sentence = _help(docs.get(f.name, ""), None)
            group.add_argument("--" + positive.replace("_", "-"), dest=positive, action=argparse.BooleanOptionalAction,
                               default=None, help=f"{positive.replace('_', ' ').capitalize()} "
                               f"{'off' if f.default else 'on'} by default; --no-{positive.replace('_', '-')}: "
                               f"{sentence[:1].lower() + sentence[1:]}")
            group.add_argument(flag, dest=f.name, action="store_true", default=f.default, help=argparse.SUPPRESS)
            continue
        if annotation is bool or annotation == bool | None:  # --flag / --no-flag (neither: the default)
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
            continue
        kind, choices = _flag_type(annotation)
        group.add_argument(flag, type=kind, choices=choices, default=f.default, help=text)


def config_from_args(args: argparse.Namespace, config_cls: type[EngineConfig] = EngineConfig) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)}
    for name in values:
        positive = getattr(args, name.removeprefix("disable_"), None) if name.startswith("disable_") else None
        if positive is not None:  # --x / --no-x given: it wins over the old --disable-x
            values[name] = not positive
    return config_cls(**values)


def _cmd_generate(args: argparse.Namespace) -> int:
    from radixgen import Engine, SamplingParams

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        seed=args.sample_seed,
    )
    with Engine(config_from_args(args)) as engine:
        prompt: Any = args.prompt
        if not args.raw:
            prompt = engine.apply_chat_template([{"role": "user", "content": args.prompt}])
        start = time.perf_counter()
        out = engine.generate(prompt, params)
        elapsed = time.perf_counter() - start
    print(out.text)
    print(
        f"[{out.completion_tokens} tokens in {elapsed:.2f} s, {out.completion_tokens / elapsed:.1f} tok/s, "
        f"finish_reason={out.finish_reason.value}]",
        file=sys.stderr,
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args, ServerConfig)
    assert isinstance(config, ServerConfig)
    if config.replicas < 1:
        raise SystemExit(f"--replicas must be at least 1, got {config.replicas}")
    client: Any
    if config.replicas > 1 or config.ray_address:
        from radixgen.cluster.ray_serve import ClusterClient, start_replicas

        client = ClusterClient(config, start_replicas(config))
    else:
        from radixgen.ipc.client import EngineClient

        client = EngineClient(config, restarts=config.engine_restarts, attach=config.engine_address)
        client.launch()  # the model loads while the HTTP stack below is imported

    import uvicorn

    from radixgen.api.drain import DrainingServer
    from radixgen.api.server import create_app

    app = create_app(config, client=client)
    server_config = uvicorn.Config(app, host=config.host, port=config.port,
                                   log_level=config.log_level, timeout_graceful_shutdown=5)
    DrainingServer(server_config, app.state.drain).run()
    from radixgen.ipc.process import skip_exit_collection

    skip_exit_collection()
    return 0


def _cmd_engine(args: argparse.Namespace) -> int:
    """An engine process on its own, for servers started with ``--engine-address`` (it
    outlives them); SIGTERM stops it."""
    from radixgen.ipc.process import engine_process_main, listen_addresses

    folder = Path(args.listen)
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # the sockets take requests from anyone who can open them
    engine_process_main(config_from_args(args), *listen_addresses(str(folder)), listen=True)
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    """Time each CPU op's implementations on the model's shapes again and cache the choices
    engines with ``--tune-kernels`` (the default) start with."""
    from radixgen.engine.model_runner import set_compute_threads
    from radixgen.kernels import cpu_kernels
    from radixgen.models import load_model, torch_dtype
    from radixgen.models.tuning import kernel_choices

    config = config_from_args(args)
    if config.device != "cpu":
        raise ValueError(f"radixgen tune times CPU kernels; --device is {config.device}")
    threads = set_compute_threads(config.num_threads)
    loaded = load_model(config.model, dtype=config.model_dtype, device="cpu", weights=config.weights)
    choices = kernel_choices(loaded.model, torch_dtype(config.model_dtype), cpu_kernels(), threads=threads, rerun=True)
    print(f"{choices.cpu}, {threads} threads, {config.model_dtype}, weights {config.weights}")
    for choice in choices.choices:
        timed = "  ".join(f"{name} {ms:.3f} ms" for name, ms in choice.times_ms.items()) or "(only one runs here)"
        print(f"{choice.op:<24} {choice.chosen:<14} {timed}")
        for name, why in choice.skipped.items():
            print(f"{'':<24} {'':<14} {name} skipped: {why}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from radixgen.engine.simulator import CostModel, load_trace, simulate, synthetic_trace

    trace = synthetic_trace(args.synthetic, seed=args.seed) if args.synthetic else load_trace(args.trace)
    report = simulate(trace, config_from_args(args), CostModel())
    print(report.summary())
    return 0


def _cmd_bench_serving(args: argparse.Namespace) -> int:
    from radixgen.bench.cli import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixgen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    add_config_flags(gen)
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible server (engine in its own process)")
    add_config_flags(serve, ServerConfig)
    serve.set_defaults(func=_cmd_serve)

    engine = sub.add_parser("engine", help="run an engine on its own for servers to attach to (--engine-address)")
    engine.add_argument("--listen", required=True, metavar="FOLDER", help="where its ipc sockets are made")
    add_config_flags(engine)
    engine.set_defaults(func=_cmd_engine)

    tune = sub.add_parser("tune", help="time each CPU op's implementations on this machine again and cache the choices")
    add_config_flags(tune)
    tune.set_defaults(func=_cmd_tune)

    sim = sub.add_parser("simulate", help="run the scheduler on a request trace with modelled model time")
    sim.add_argument("trace", nargs="?", help="JSON-lines trace (see radixgen.engine.simulator.load_trace)")
    sim.add_argument("--synthetic", type=int, default=0, help="instead of a file, a synthetic trace of N requests")
    add_config_flags(sim)
    sim.set_defaults(func=_cmd_simulate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    serving = bench.add_parser("serving", help="a realistic streaming load against an OpenAI-compatible URL")
    from radixgen.bench.cli import add_arguments

    add_arguments(serving)
    serving.add_argument("--log-level", default="warning")
    serving.set_defaults(func=_cmd_bench_serving)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except ValueError as e:  # a user error: say what to change, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
