"""One configuration object flows from the CLI to every part of the engine.

Leaf classes take plain values derived from it; values discovered at run time (pool size in
slots, thread count actually used) are kept by the part that discovers them, never written back.
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field, fields
from typing import Literal

from radixgen.tool_formats import DEFAULT_CALL_THRESHOLD

DType = Literal["auto", "float32", "bfloat16", "float16"]
SchedulePolicy = Literal["fcfs", "lpm"]
Routing = Literal["prefix-affinity", "round-robin"]
AttentionBackend = Literal["auto", "cpu", "torch", "triton"]
GrammarBackend = Literal["auto", "xgrammar", "llguidance", "outlines"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
Weights = Literal["auto", "float", "int8", "int4"]
RepeatedItems = Literal["unique", "all", "off"]
Speculative = Literal["off", "auto", "ngram"]


def check_choices(config: object) -> None:
    """Refuse a value outside a field's fixed set of choices (a ``Literal`` annotation), naming
    the field, the value and the choices: a typo must not fall back to some default path."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):  # type: ignore[arg-type]
        annotation = hints[f.name]
        allowed: tuple[object, ...] = ()
        if typing.get_origin(annotation) is Literal:
            allowed = typing.get_args(annotation)
        elif typing.get_origin(annotation) is typing.Union:  # Literal[...] | None
            for arg in typing.get_args(annotation):
                if typing.get_origin(arg) is Literal:
                    allowed = (*typing.get_args(arg), None)
        value = getattr(config, f.name)
        if allowed and value not in allowed:
            choices = ", ".join(repr(a) for a in allowed)
            raise ValueError(f"{f.name} must be one of {choices}; got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. CLI flags are generated from these fields."""

    model: str | None = None
    """HF folder (config.json + safetensors), a .gguf file, or None for bundled SmolLM2-135M."""
    dtype: DType = "auto"
    """auto: float32 on CPU, bfloat16 on CUDA (``model_dtype``). float32 is exact against
    transformers; bfloat16 is the fast option on AVX-512 BF16 CPUs and on GPUs."""
    weights: Weights = "auto"
    """How the linear weights are held. auto: on CPU a GGUF file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 /
    Q4_K / Q5_K / Q6_K blocks as they are (repacked, never dequantized), on CUDA dequantized to ``dtype`` at load
    (no GPU kernel runs the blocks yet), any other checkpoint in ``dtype``. float:
    everything in ``dtype``. int8 / int4: weight-only quantized in groups of 32 (a float
    checkpoint is quantized at load). Activations stay in ``dtype``."""
    device: str = "cpu"
    """cpu, cuda or cuda:N."""
    num_threads: int | None = None
    """torch compute threads; None means the cores this process may run on."""
    attention_backend: AttentionBackend = "auto"
    """cpu: radixgen's C++ decode, prefill and shared-prefix kernels over the pool (built once
    per machine with the system compiler, under half a minute, cached under
    $RADIXGEN_CACHE/kernels), SDPA where they cannot be built. torch: request by request on
    PyTorch ops (the reference; any device). triton: Triton decode and extend kernels reading
    the pool in place (CUDA; on a CPU only under Triton's interpreter, for tests). auto: cpu on
    CPU, triton on CUDA (models/attention/)."""
    small_linear_max_tokens: int | None = None
    """CPU: steps with at most this many tokens (batch-1 and batch-2 decode) run the linear
    layers as matrix-vector products over a plain copy of each weight kept beside oneDNN's
    packed one. The copy costs the linear weights' size in memory again (a tied LM head shares
    the embedding); 0 turns the path off and frees it. None: up to the size where it measured
    faster than oneDNN on this machine (``tune_kernels``), 2 without tuning."""
    tune_kernels: bool = True
    """CPU: choose each op's implementation (prefill and decode attention, small-step linears)
    by timing them on the model's shapes at the first start on this machine, cached under
    $RADIXGEN_CACHE/tuning (``radixgen tune`` times again). Off: fixed rules by CPU flags, as
    with ``RADIXGEN_TUNE_KERNELS=0`` in the environment (the test suite sets it)."""
    seed: int = 0
    """Seed for requests that give none (each such request still gets its own stream)."""

    max_context_len: int | None = None
    """Cap on prompt + output tokens per request; None means the model's own limit."""
    kv_cache_tokens: int | None = None
    """KV pool size in tokens; None derives it from kv_cache_gb."""
    kv_cache_gb: float | None = None
    """KV pool size in GiB; None: 2 on CPU, on CUDA ``mem_fraction`` of the device memory free
    after the weights are loaded."""
    mem_fraction: float = 0.85
    """CUDA: the share of the device memory free after loading the weights that the KV pool
    takes when neither kv_cache_tokens nor kv_cache_gb is given (the rest is left for the
    step's activations and logits)."""
    max_running_requests: int = 128
    """Most requests decoding at once; more wait in the queue (their prompts not yet computed)."""
    max_prefill_tokens: int = 4096
    """Token budget of one prefill step."""
    chunked_prefill_size: int = 2048
    """Longest piece of one prompt computed in a step; longer prompts are split, with decode
    steps in between. 0 disables chunking."""
    max_mixed_prefill_tokens: int = 1024
    """Prefill-token budget of a step that also decodes running requests: bounds the time
    between their tokens and how long a new arrival waits for the step in flight (serving
    benchmark, bf16: TTFT p99 0.98 s with 4096, 0.46 s with 1024, the same throughput)."""
    mixed_steps: bool = True
    """Running requests decode their next token inside every prefill step (one forward, the
    weights read once) instead of waiting for the prefill queue to drain; attention still takes
    each part its own way. Off: prefill and decode steps strictly alternate by queue state."""
    prefill_alone_below_tokens: int = 256
    """With ``mixed_steps``, a prefill of new requests computing fewer tokens than this runs in a
    step of its own, and the running requests decode in the next one: a short prompt's first
    token does not wait for a whole decode batch's step, while a long one still rides with the
    decodes (as do jump-forward's requeued tokens). 0: every prefill is mixed."""
    max_queued_requests: int = 4096
    """Most requests in flight, running and waiting; past it a new request is refused (HTTP 429 at
    the server)."""
    schedule_policy: SchedulePolicy = "lpm"
    """lpm: longest cached prefix first (fcfs when the queue is long); fcfs: arrival order."""
    disable_radix_cache: bool = False
    """Do not share cached prompt prefixes between requests (each prompt is computed in full)."""
    grammar_backend: GrammarBackend = "auto"
    """Constraint compiler: auto (xgrammar for regexes and the JSON Schema subset real APIs use,
    llguidance for the rest; measured in constraints/auto_backend.py), xgrammar or llguidance."""
    json_open_objects: bool = False
    """Let JSON output carry properties its schema does not declare wherever the schema allows
    them (JSON Schema's own reading). Off: only declared properties are generated, as in SGLang
    and vLLM; a schema that sets additionalProperties or patternProperties is followed either way."""
    json_max_recursion_depth: int = 8
    """How deep a recursive schema definition may nest in generated JSON (past it the recursive
    branch is closed: an empty array of children, the null alternative)."""
    grammar_compile_timeout_s: float = 30.0
    """Longest a constraint's compile may run before its request is refused; the compile goes on
    and lands in the cache, so the same constraint sent again is served once it is done."""
    max_schema_bytes: int = 256 * 1024
    """Largest JSON schema (compact JSON) a request may give."""
    max_schema_depth: int = 64
    """Deepest nesting of a request's JSON schema (at most 64, the hard cap)."""
    max_new_tokens_limit: int | None = None
    """Largest max_new_tokens / max_tokens a request may ask for; None: whatever fits the context."""
    jump_forward: bool = True
    """Append text a constraint forces without a decode step per token (computed in one extend
    on top of the cached sequence; with the radix cache disabled the forced tokens are decoded,
    or drafted, instead: the extend would compute the whole sequence again)."""
    jump_forward_max_batch: int = 4
    """Jump forward only while at most this many requests decode: a larger batch already shares
    each step, and the extra extend step would cost more than the steps it saves (measured:
    batch 32, 0.60 s per object with it against 0.41 s without)."""
    speculative: Speculative = "auto"
    """Drafting, verified in the decode step so the output is token for token what it would have
    been (engine/speculative.py). A request drafts the text its constraint forces next and the
    tokens that followed the latest earlier occurrence of its last tokens in its prompt (a copied
    span) or its output (an n-gram), each draft cut where the constraint's automaton rejects it;
    a request whose drafts stop paying for their verification at the batch size stops drafting.
    auto: constrained requests draft (their answers are mostly copied or forced text); ngram:
    every request; off: none. A request's ``speculative`` overrides it either way."""
    speculative_max_draft: int = 10
    """Most tokens one request drafts per step of the text its constraint forces, and as many
    again of guessed tokens (copied or n-gram) after it: the guess is as long as its kind of
    guess has lately run right, at most this (speculative.GuessLengths)."""
    speculative_max_batch: int | None = None
    """auto: requests draft only while at most this many decode. None (default): measured on
    this machine, per batch size: a request drafts where the engine's own step times say its
    drafted tokens are accepted often enough to pay for the positions they add (a batch size not
    yet measured drafts, to measure it). A larger batch already shares each step's weight
    reads, so on a few CPU cores drafting stops paying somewhere past 8."""
    speculative_step_budget: int = 64
    """Most draft tokens per step across the batch."""
    speculative_ngram_max: int = 3
    """Longest n-gram matched against the request's tokens (the longest match wins)."""
    json_repeated_items: RepeatedItems = "unique"
    """What an array item that repeats an earlier item of its array does: unique (default) rolls
    it back and resamples it in arrays whose schema sets uniqueItems (a repeat is invalid there:
    caught as the item ends rather than when the array does); all does that in every array,
    against the loop small models fall into, but then a schema that allows duplicates cannot
    get them (and JSON outputs no longer stream, validators being attached); off never does."""
    budget_steering: bool = True
    """Constrained outputs always finish within max_new_tokens: a request whose tokens left come
    close to the cheapest valid completion is steered to close (engine/steering.py), and one
    whose shortest valid output cannot fit is refused before generation."""
    budget_margin_tokens: int = 8
    """How close to that point steering starts closing softly: a string ends at the next word
    boundary, an array or object at its next item, before the rest is forced."""
    overlap: bool | None = None
    """Overlapped scheduling: the forward and sampling of each step run on a worker thread, and
    the next decode step is planned and started as soon as this one's tokens are read back,
    before its results are applied, so that the host's work (detokenising, stops, constraint
    masks, streaming) hides behind the device's (engine/step.py). Outputs are the same either
    way. None: on with CUDA, off on a CPU (where the forward already uses every core)."""
    cuda_graphs: bool = True
    """CUDA: decode steps replay CUDA graphs captured at start-up for batch-size buckets (1, 2, 4,
    8, then steps of 8 up to ``cuda_graph_max_batch``), padded up to their bucket, so a step is
    a few launches instead of one per op (engine/graph_runner.py). Ignored on a CPU."""
    cuda_graph_max_batch: int = 256
    """Largest decode batch run from a graph (capped at max_running_requests); larger ones run
    eagerly; 0: none."""
    event_log: str | None = None
    """Path of a JSON-lines log with one record per scheduler step (off when None)."""

    log_level: LogLevel = "info"

    def __post_init__(self) -> None:
        check_choices(self)
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N; got {self.device!r}")
        if not 0.0 < self.mem_fraction < 1.0:
            raise ValueError(f"mem_fraction must be between 0 and 1, got {self.mem_fraction}")
        if self.device != "cpu" and self.weights in ("int8", "int4"):
            raise ValueError(f"weights {self.weights!r} runs on the CPU only for now; on {self.device} use "
                             "weights 'auto' or 'float' (GGUF blocks are dequantized to dtype at load)")
        if self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be 0 (no graphs) or more, got {self.cuda_graph_max_batch}")
        for name in ("max_prefill_tokens", "max_mixed_prefill_tokens", "max_running_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prefill_alone_below_tokens < 0:
            raise ValueError(f"prefill_alone_below_tokens must be 0 (always mixed) or more, "
                             f"got {self.prefill_alone_below_tokens}")

    @property
    def model_dtype(self) -> str:
        """``dtype`` with ``auto`` resolved for the device."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def use_overlap(self) -> bool:
        """``overlap`` with None resolved for the device."""
        return self.is_cuda if self.overlap is None else self.overlap

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True)
class ServerConfig(EngineConfig):
    host: str = "127.0.0.1"
    """Loopback by default; binding elsewhere is an explicit choice."""
    port: int = 30000
    """The port the server listens on."""
    served_model_name: str | None = None
    """The name /v1/models reports and requests may give as ``model``; None: the model folder's
    or GGUF file's name (SmolLM2-135M-Instruct for the bundled model)."""
    api_key: str | None = field(default=None, repr=False)
    """When set, every endpoint but /health needs 'Authorization: Bearer <key>'. The environment
    variable RADIXGEN_API_KEY is used when the flag is absent (keeps the key out of `ps`)."""
    replicas: int = 1
    """Engine replicas; more than one runs each as a Ray Serve application (pip install
    'radixgen[ray]') behind this server's routes."""
    ray_address: str | None = None
    """An existing Ray cluster to deploy the replicas on ("auto", "ray://host:10001"); default:
    a private local Ray on loopback."""
    routing: Routing = "prefix-affinity"
    """How the front picks a replica: prefix-affinity (requests sharing a prefix go where it is
    cached, within a load bound) or round-robin."""
    max_request_bytes: int = 4 * 2**20
    """Largest request body accepted; larger ones get HTTP 413."""
    max_n: int = 16
    """Largest `n` (choices per request)."""
    shutdown_timeout: float = 30.0
    """On SIGTERM / SIGINT: seconds the requests in flight get to finish (new ones get 503 with
    Retry-After meanwhile); what is still running then ends with 503. A second signal stops at once."""
    engine_address: str | None = None
    """Attach to an engine started on its own with ``radixgen engine --listen FOLDER`` instead
    of starting one: the engine outlives this server (restart the server without reloading the
    model or losing the prefix cache). One server at a time: a server that attaches aborts what
    an earlier one left running. The engine's own options are the ones it was started with."""
    engine_restarts: int = 3
    """How many times the server starts a crashed engine process again (0: never); requests in
    flight when it crashed get HTTP 503."""
    tool_call_decision: Literal["auto", "model", "scored"] = "auto"
    """How ``tool_choice="auto"`` decides between a call and a text answer. model: the model
    starts a call by writing its trigger. scored: the model's scores decide first (a call's
    opening, as likely after the question as ``tool_call_threshold`` nats more than after a
    content-free one, makes the turn a call), for models not trained to call on their own.
    auto: scored for templates that render no tools (the bundled SmolLM2), model otherwise."""
    tool_call_threshold: float = DEFAULT_CALL_THRESHOLD
    """The scored decision's bar, in nats (tool_formats.DEFAULT_CALL_THRESHOLD says how it was measured)."""
