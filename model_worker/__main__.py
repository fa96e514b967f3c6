"""Entry point: python -m model_worker [flags]; parses Config, loads the model, serves gRPC.

Wires model_files -> ModelRunner -> LLMEngine -> EngineLoop -> ModelWorkerServicer.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import logging
import os
from pathlib import Path

import grpc
import torch

from model_worker.config import Config
from model_worker.engine import LLMEngine, default_eos_ids
from model_worker.engine_loop import EngineLoop, new_engine_thread
from model_worker.host_memory import keep_freed_memory_in_heap
from model_worker.kernels import GGUF_LINEAR_FLAGS, cpu_flags
from model_worker.model_files import ModelNotFoundError, gguf_weight_types, model_id_for, resolve_model_dir
from model_worker.model_runner import ModelRunner, model_shape, resolve_device, resolve_dtype
from model_worker.models.hf_fallback import HFShape
from model_worker.models.linear import GGUF_FORMAT_MAX_TOKENS, Linear
from model_worker.models.llama import LlamaShape
from model_worker.servicer import ModelWorkerServicer
from model_worker.structured_output import GrammarCompiler
from tokenwire import grpc_server
from tokenwire.config_cli import parse_config
from tokenwire.gc_heap import freeze_startup_heap, pause_collections_until_frozen
from tokenwire.grpc_io import log_io_note
from tokenwire.sched_slice import use_serving_slice
from tokenwire.stack import ENV_PREFIXES, exit_with_the_stack
from tokenwire.tokenizer_files import num_token_ids, tokenizer_identity
from tokenwire.v1 import model_worker_pb2 as pb
from tokenwire.v1 import model_worker_pb2_grpc

logger = logging.getLogger("model_worker")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ModelWorker"].full_name


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def chat_template_of(model_dir: Path) -> str:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = _read_json(model_dir / "tokenizer_config.json").get("chat_template") or ""
    return template if isinstance(template, str) else ""


# Where config.json gives a model's trained context, in the spellings of the families (vLLM's list).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def model_context_len(hf_config: dict) -> int:
    """The longest context the model was built for, as vLLM derives it: the smallest of the keys
    config.json (or its text_config) sets, times the factor of a linear, dynamic or yarn rope
    scaling (yarn's over its original length); 2048 where none is set."""
    sources = [hf_config, hf_config.get("text_config") or {}]
    lengths = [c[k] for c in sources for k in _CONTEXT_KEYS if isinstance(c.get(k), int) and c[k] > 0]
    context = min(lengths) if lengths else 2048
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") if isinstance(rope, dict) else None
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if rope_type in ("linear", "dynamic", "yarn") and isinstance(factor, (int, float)) and factor > 1:
        if rope_type == "yarn":
            context = rope.get("original_max_position_embeddings") or hf_config.get(
                "original_max_position_embeddings") or context
        context = int(context * factor)
    return context


def tokenizer_eos_id(model_dir: Path) -> int | None:
    """The id of tokenizer_config.json's eos_token in tokenizer.json, if both say one."""
    eos = _read_json(model_dir / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):  # an AddedToken written out: {"content": "</s>", ...}
        eos = eos.get("content")
    if not isinstance(eos, str) or not (model_dir / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(eos)


def build_model_info(config: Config, model_dir: Path, hf_config: dict, runner: ModelRunner,
                     eos_ids: list[int]) -> pb.ModelInfo:
    return pb.ModelInfo(
        model_id=config.served_model_name or model_id_for(config.model, model_dir),
        vocab_size=runner.vocab_size,
        eos_token_ids=eos_ids,
        max_model_len=runner.max_model_len,
        chat_template=chat_template_of(model_dir),
        tokenizer=tokenizer_identity(model_dir),
        bos_token_id=hf_config.get("bos_token_id") or 0,
        dtype=str(runner.dtype).removeprefix("torch."),
        device=str(runner.device),
        kv_cache_tokens=runner.kv_cache.num_blocks * runner.kv_cache.block_size,
        generation_defaults=(generation_defaults(_read_json(model_dir / "generation_config.json"))
                             if config.generation_config == "auto" else None),
    )


# The sampling fields vLLM takes from generation_config.json, and transformers' GenerationConfig
# default of each: a file's value equal to it is not in its to_diff_dict(), which vLLM reads.
_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
                        "max_new_tokens": None}


def generation_defaults(generation_config: dict) -> pb.GenerationDefaults:
    """The model's sampling defaults (--generation-config auto), as vLLM reads them: each field
    generation_config.json sets to a number other than transformers' own default."""
    defaults = pb.GenerationDefaults()
    for name, hf_default in _GENERATION_DEFAULTS.items():
        value = generation_config.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value == hf_default:
            continue
        setattr(defaults, name, int(value) if name in ("top_k", "max_new_tokens") else float(value))
    return defaults


def gguf_small_steps(config: Config, model_dir: Path, hf_config: dict, device: torch.device,
                     dtype: torch.dtype) -> tuple[bool, bool]:
    """(--int4-small-batch resolved, the lm_head on the file's Q8_0). --int4-small-batch is on, off,
    or auto, which is on for a GGUF whose decoder matmuls are all Q4_1 (the int4 copy is then the
    file's own weights), run on the CPU in bf16 with no flag that excludes it. With it, a GGUF's
    Q8_0 lm_head keeps a Q8_0 copy for the same steps."""
    if config.int4_small_batch == "off":
        return False, False
    if config.int4_small_batch == "auto" and (
            device.type != "cpu" or dtype != torch.bfloat16 or config.int8_small_batch or config.bf16_small_batch
            or config.batch_invariant or not config.cpu_decode_kernel
            or not isinstance(model_shape(hf_config), LlamaShape)
            or not GGUF_LINEAR_FLAGS <= cpu_flags()):
        return False, False
    layer_types, head_type = gguf_weight_types(model_dir)
    if config.int4_small_batch == "auto":
        if layer_types != {"Q4_1"}:
            return False, False
        logger.info("--int4-small-batch auto: the GGUF's layer weights are Q4_1 (lm_head %s); steps of <= %d tokens "
                    "run on them as the file holds them", head_type, GGUF_FORMAT_MAX_TOKENS["q4_1"])
    return True, head_type == "Q8_0"


def warn_if_gguf_blocks_rounded(runner: ModelRunner, model_dir: Path) -> None:
    """A GGUF's Q4_1 / Q8_0 blocks come back exactly from its dequantized weights when llama.cpp's
    plain quantizer made them; one made with an importance matrix may not span each group's 0..15,
    and re-quantizing rounds its weights once more. Said once at startup, not hidden."""
    layers = getattr(runner.model, "layers", None)
    if not layers:
        return
    linears = [*(v for layer in layers for v in layer.values() if isinstance(v, Linear)), runner.model.lm_head]
    rounded = [linear for linear in linears if linear.gguf_blocks is not None and not linear.gguf_exact]
    if rounded and gguf_weight_types(model_dir)[0]:  # another model's weights are rounded by design
        logger.warning("--int4-small-batch: %d of %d GGUF-format copies are not the file's exact blocks (an "
                       "importance-matrix quantization?): their small steps run a second rounding of its weights",
                       len(rounded), sum(linear.gguf_blocks is not None for linear in linears))


def build_engine(config: Config) -> tuple[LLMEngine, Path, dict, list[int]]:
    """The engine a Config describes, with its model dir, HF config and eos ids; serve() and
    the engine-alone benchmark both build it here, so they cannot drift apart."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if config.keep_freed_host_memory:
        keep_freed_memory_in_heap()
    model_dir = resolve_model_dir(config.model, Path(config.cache_dir))
    hf_config = _read_json(model_dir / "config.json")
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    context = model_context_len(hf_config)
    if config.max_model_len > context:
        # Past its positions a model with learned ones fails the step that gets there, and rotary
        # ones run on untrained angles; vLLM refuses it too.
        raise ValueError(f"--max-model-len {config.max_model_len} is beyond the model's context of {context} "
                         "tokens (config.json's max_position_embeddings, or n_positions, with its rope scaling)")
    max_model_len = config.max_model_len or min(context, 2048)
    runner = ModelRunner(model_dir, config.load_format, device, dtype, config.max_num_seqs, max_model_len,
                         config.block_size, config.kv_cache_tokens, config.kv_cache_memory_bytes,
                         config.gpu_memory_utilization, config.int8_small_batch, config.batch_invariant,
                         config.cpu_decode_kernel, Path(config.cache_dir) / "kernels",
                         config.decode_graphs_on(device.type, not isinstance(model_shape(hf_config), HFShape)),
                         config.bf16_small_batch, config.cpu_bf16_matmul,
                         *gguf_small_steps(config, model_dir, hf_config, device, dtype),
                         cuda_kernels=config.cuda_kernels)
    warn_if_gguf_blocks_rounded(runner, model_dir)
    eos_ids = default_eos_ids(_read_json(model_dir / "generation_config.json"), hf_config, tokenizer_eos_id(model_dir))
    engine = LLMEngine(runner, eos_ids, config.max_num_seqs, config.max_num_batched_tokens,
                       config.max_waiting_requests, config.seed, config.enable_prefix_caching, config.max_best_of,
                       num_token_ids(model_dir), config.max_logprobs)
    return engine, model_dir, hf_config, eos_ids


async def drain(servicer: ModelWorkerServicer) -> None:
    """The drain's end: once no request has run for DRAIN_QUIET_S (a gateway that has not yet seen
    NOT_SERVING may still be adding one), each Generate call is ended so its last frames go out
    before the server cancels calls."""
    await grpc_server.wait_quiet(servicer.is_drained)
    servicer.begin_drain()


async def watch_engine(loop: EngineLoop, health, step_timeout_s: float = 0.0, poll_s: float = 1.0) -> str:
    """Health NOT_SERVING for good once the engine cannot serve, and why, for serve() to end the
    worker (exit_hung), so that whatever supervises it (tokenwire.stack, compose, Kubernetes)
    starts a new one: once EngineLoop.healthy is false (its steps keep failing, or its thread
    ended; a worker that only said NOT_SERVING ran on, and only Kubernetes' liveness probe would
    have restarted it: the stack's /ready answered 503 for good), or once a step has run past
    step_timeout_s (0: never checked). A step that holds the GIL stops this loop too:
    EngineLoop.arm_fault_timer covers that one."""
    while loop.healthy:
        running_s = loop.step_running_s if step_timeout_s else 0.0
        if running_s > step_timeout_s:
            logger.error("the engine's step has run %.1fs (--step-timeout-s %g); the engine thread is at:\n%s",
                         running_s, step_timeout_s, loop.engine_thread_stack())
            await grpc_server.mark_not_serving(health, [SERVICE_NAME])
            return (f"the model worker's engine step has not returned in {running_s:.0f}s (--step-timeout-s "
                    f"{step_timeout_s:g}): taken as hung, the worker exits to be restarted")
        await asyncio.sleep(poll_s)
    logger.error("the engine cannot serve (its steps keep failing, or its thread ended): health NOT_SERVING")
    await grpc_server.mark_not_serving(health, [SERVICE_NAME])
    return "the model worker's engine cannot serve (its steps keep failing, or its thread ended): the worker exits " \
           "to be restarted"


# After a hung step, how long the Generate calls get to send their UNAVAILABLE before the exit.
HUNG_FLUSH_S = 1.0
# faulthandler's exit (a step holding the GIL) comes this long after --step-timeout-s, so that a
# hang watch_engine can see (the GIL released) ends by exit_hung first: its look every second, the
# flush, and the timer's re-arming once a second.
FAULT_TIMER_SLACK_S = 5.0
HUNG_EXIT_STATUS = 1
# os._exit: the engine thread cannot be stopped or joined, so a normal exit would wait for it
# forever (interpreter shutdown joins an executor's threads). Tests replace it.
exit_process = os._exit


async def exit_hung(servicer: ModelWorkerServicer, server: grpc.aio.Server, why: str) -> None:
    """A hung engine step: every request of the worker waits on it, and nothing can cancel it.
    Each Generate call ends with UNAVAILABLE and why (the gateway fails its requests with that at
    once, where they would wait for their clients' time-outs), then the process exits for its
    supervisor (tokenwire.stack, Kubernetes, compose) to start a new one, as SGLang's watchdog."""
    faulthandler.cancel_dump_traceback_later()  # this exit, not the bare one, while the event loop runs
    servicer.fail_streams(grpc.StatusCode.UNAVAILABLE, why)
    with contextlib.suppress(Exception):
        await server.stop(HUNG_FLUSH_S)  # the calls end by themselves; then the rest is cancelled
    exit_now(why)


def exit_now(why: str) -> None:
    logger.critical("exiting with status %d: %s", HUNG_EXIT_STATUS, why)
    logging.shutdown()
    exit_process(HUNG_EXIT_STATUS)


def check_served_model_files(model: str) -> None:
    """A model dir the stack can serve has tokenizer.json (the gateway and the detok workers read
    it, and ModelInfo names it): said before the weights load, not after."""
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        raise ModelNotFoundError(f"--model {model}: no tokenizer.json there (the tokenizers library's file, which "
                                 "transformers' save_pretrained writes); the gateway and detok workers need it")


async def serve(config: Config) -> None:
    # What the worker cannot start with is one line, found before the model loads where it can
    # be, else as the load finds it.
    grpc_server.check_port(config.host, config.port)
    try:
        check_served_model_files(config.model)
    except ModelNotFoundError as exc:
        raise grpc_server.StartupError(str(exc)) from exc
    # Built on the thread that will run its steps, so torch has one OpenMP team (see new_engine_thread).
    engine_thread = new_engine_thread()
    try:
        engine, model_dir, hf_config, eos_ids = await asyncio.get_running_loop().run_in_executor(
            engine_thread, build_engine, config)
    except (ModelNotFoundError, ValueError, OSError) as exc:
        raise grpc_server.StartupError(f"cannot start: {exc}") from exc
    runner = engine.runner
    # The engine thread (and torch's OpenMP threads, which it started) keep the kernel's default
    # time slice; from here this thread and the ones it starts (the output handover, gRPC's) are
    # the serving path's.
    use_serving_slice(config, "model worker", whole_process=False)
    # Structured output: llguidance's token trie from tokenizer.json (~1 s, once).
    tokenizer_json = model_dir / "tokenizer.json"
    grammar_compiler = None
    if tokenizer_json.is_file():
        try:
            grammar_compiler = GrammarCompiler.from_tokenizer_file(tokenizer_json, runner.vocab_size, eos_ids)
        except ValueError as exc:  # e.g. an EOS id the tokenizer does not have: serve, without constraints
            logger.warning("structured output is off: llguidance refused %s: %s", tokenizer_json, exc)
    freeze_startup_heap("model worker")
    loop = EngineLoop(engine, grammar_compiler, engine_thread, config.stream_interval)
    if config.step_timeout_s:
        loop.fault_timeout_s = config.step_timeout_s + FAULT_TIMER_SLACK_S
    # Started inside the try: its thread waits for work until stop(), and a process whose
    # startup failed after it started would otherwise never exit.
    watcher: asyncio.Task | None = None
    try:
        loop.start()
        server = grpc_server.new_server()
        model_info = build_model_info(config, model_dir, hf_config, runner, eos_ids)
        if model_info.generation_defaults.ListFields():  # vLLM says so too: answers differ from the API's defaults
            logger.info("requests that leave them unset take generation_config.json's %s (--generation-config vllm: "
                        "the API's defaults)", " ".join(str(model_info.generation_defaults).split()))
        servicer = ModelWorkerServicer(loop, model_info)
        model_worker_pb2_grpc.add_ModelWorkerServicer_to_server(servicer, server)
        health = grpc_server.add_health_and_reflection(server, [SERVICE_NAME])
        await grpc_server.mark_serving(health, [SERVICE_NAME])
        watcher = asyncio.create_task(watch_engine(loop, health, config.step_timeout_s))
        serving = asyncio.create_task(grpc_server.serve_until_signal(
            server, config.address, config.drain_grace_s, config.tls, health, drained=lambda: drain(servicer)))
        try:
            await asyncio.wait({watcher, serving}, return_when=asyncio.FIRST_COMPLETED)
            if watcher.done():
                await exit_hung(servicer, server, watcher.result())
            await serving
        finally:
            serving.cancel()
    finally:
        await stop_engine(loop, watcher)


async def stop_engine(loop: EngineLoop, watcher: asyncio.Task | None) -> None:
    """loop.stop(), still watched: it waits for the step running, and one that hangs while the
    worker drains or stops would hold the process for good."""
    stopping = asyncio.create_task(loop.stop())
    if watcher is not None and not watcher.done():
        await asyncio.wait({stopping, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():
            exit_now(watcher.result())
        watcher.cancel()
    await stopping


def main() -> None:
    exit_with_the_stack()  # started by `python -m tokenwire.stack`: end with it
    config = parse_config(Config, env_prefix=ENV_PREFIXES["model_worker"])
    pause_collections_until_frozen()  # serve() freezes the heap once the engine is built
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_io_note()
    grpc_server.run_worker("model_worker", serve(config))


if __name__ == "__main__":
    main()
