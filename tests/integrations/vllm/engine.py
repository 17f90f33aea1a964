"""A whole ``vllm.LLM`` engine on the CPU build, with a tiny Llama of random weights.

Used by the ``system`` tests (``test_llm.py``) and by
``benchmarks/bench_vllm_engine.py``. Each engine runs in a subprocess of its
own (``python -m tests.integrations.vllm.engine RUN.json``), as vLLM's
multiprocess executor wants a ``__main__`` it can spawn from; it writes a
JSON result next to the run file.

The model: ``write_tiny_llama`` writes a 2-layer Llama with random weights
(a seeded, scaled normal init) into a safetensors file. ``load_format=
"dummy"`` weights would give nearly uniform logits, whose argmax barely
depends on the prompt, so a token-identity check would pass whatever KV a
request attended over; these weights make the next token depend on the
prefix's KV (``test_llm`` checks that it does).

The workload (``Workload``): ``docs`` shared prefixes of ``prefix_tokens``
tokens, each request one prefix plus a short question of its own, sent in
rounds that cycle through the prefixes, against a GPU KV cache smaller than
all prefixes together: without offloading each round recomputes prefixes
the GPU cache evicted; with a CPU pool they come back from it.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
VOCAB = 512
INTERMEDIATE = 256
BLOCK_SIZE = 32  # the CPU attention backend refuses 16

AIOKVO = {"spec_name": "AiokvoOffloadingSpec", "spec_module_path": "aiokvo.integrations.vllm"}
FAILING = {"spec_name": "FailingCopyAiokvoOffloadingSpec",
           "spec_module_path": "tests.integrations.vllm.specs"}

ENGINE_ENV = {
    # vLLM's `auto` thread binding reserves one more core when a KV connector is
    # configured; fixed binding keeps the configurations comparable on 2 cores.
    "VLLM_CPU_OMP_THREADS_BIND": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_HOST_IP": "127.0.0.1",  # the executor's message queues stay on loopback
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def write_tiny_llama(
    path: Path,
    seed: int = 0,
    *,
    hidden: int = HIDDEN,
    layers: int = LAYERS,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    intermediate: int = INTERMEDIATE,
) -> Path:
    """A random-weight Llama (config.json + model.safetensors) in ``path``; the
    defaults are the tests' tiny one, the benchmark asks for a larger one."""
    import torch
    from safetensors.torch import save_file

    HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = (
        hidden, layers, heads, kv_heads, intermediate
    )
    path.mkdir(parents=True, exist_ok=True)
    head_dim = HIDDEN // HEADS
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "float32", "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2, "head_dim": head_dim,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).contiguous()

    fan = HIDDEN**-0.5
    tensors = {
        "model.embed_tokens.weight": normal(VOCAB, HIDDEN, scale=1.0),
        "model.norm.weight": torch.ones(HIDDEN),
        # Sharper than 1/sqrt(fan-in): logits with a clear argmax, and attention
        # scores that pick out positions, so the next token follows the prefix.
        "lm_head.weight": normal(VOCAB, HIDDEN, scale=4 * fan),
    }
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        tensors.update({
            pre + "input_layernorm.weight": torch.ones(HIDDEN),
            pre + "post_attention_layernorm.weight": torch.ones(HIDDEN),
            pre + "self_attn.q_proj.weight": normal(HEADS * head_dim, HIDDEN, scale=3 * fan),
            pre + "self_attn.k_proj.weight": normal(KV_HEADS * head_dim, HIDDEN, scale=3 * fan),
            pre + "self_attn.v_proj.weight": normal(KV_HEADS * head_dim, HIDDEN, scale=fan),
            pre + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * head_dim, scale=fan),
            pre + "mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN, scale=fan),
            pre + "mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN, scale=fan),
            pre + "mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE,
                                                 scale=INTERMEDIATE**-0.5),
        })  # fmt: skip
    save_file(tensors, str(path / "model.safetensors"))
    return path


def kv_bytes_per_token(model: str | Path) -> int:
    """KV bytes one token takes in the model's cache (K and V, float32)."""
    c = json.loads((Path(model) / "config.json").read_text())
    return int(c["num_hidden_layers"]) * 2 * int(c["num_key_value_heads"]) * int(c["head_dim"]) * 4


@dataclass
class Workload:
    docs: int = 12
    prefix_tokens: int = 512
    question_tokens: tuple[int, int] = (8, 40)
    requests: int = 240
    round_size: int = 12  # requests submitted together (one llm.generate call)
    max_tokens: int = 8
    seed: int = 0

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        docs = [[rng.randrange(10, VOCAB) for _ in range(self.prefix_tokens)]
                for _ in range(self.docs)]
        out = []
        for i in range(self.requests):
            length = rng.randrange(*self.question_tokens)
            question = [rng.randrange(10, VOCAB) for _ in range(length)]
            out.append(docs[i % self.docs] + question)  # a cycle: the GPU cache's LRU worst case
        return out


@dataclass
class Run:
    """One engine run, as the subprocess reads it from JSON."""

    model: str
    workload: Workload = field(default_factory=Workload)
    spec: dict[str, Any] | None = None  # kv_connector_extra_config without cpu_bytes_to_use
    cpu_bytes: int = 256 << 20
    gpu_kv_tokens: int = 4096
    max_num_seqs: int = 16
    probes: bool = False  # also generate the prefix-dependence probes
    extra_config: dict[str, Any] = field(default_factory=dict)


def _metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            out[metric.name] = out.get(metric.name, 0.0) + float(value)
        elif getattr(metric, "count", None) is not None:  # a histogram
            out[metric.name + ":count"] = out.get(metric.name + ":count", 0) + metric.count
            out[metric.name + ":sum"] = out.get(metric.name + ":sum", 0.0) + metric.sum
    return out


def probe_prompts(seed: int = 99) -> list[list[int]]:
    """Pairs of prompts with the same last 64 tokens: a different prefix, and one
    that differs from the other only in its first token."""
    rng = random.Random(seed)
    out = []
    for _ in range(4):
        tail = [rng.randrange(10, VOCAB) for _ in range(64)]
        a = [rng.randrange(10, VOCAB) for _ in range(256)]
        b = [rng.randrange(10, VOCAB) for _ in range(256)]
        c = [(a[0] + 1 - 10) % (VOCAB - 10) + 10, *a[1:]]
        out += [a + tail, b + tail, c + tail]
    return out


def run_engine(run: Run) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if run.spec is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={**run.spec, "cpu_bytes_to_use": run.cpu_bytes,
                                       **run.extra_config},
        )  # fmt: skip
    t0 = time.perf_counter()
    llm = LLM(
        model=run.model, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK_SIZE,
        max_model_len=2048, enable_prefix_caching=True, seed=0, enforce_eager=True,
        kv_cache_memory_bytes=run.gpu_kv_tokens * kv_bytes_per_token(run.model),
        max_num_seqs=run.max_num_seqs, disable_log_stats=False, **kwargs,
    )  # fmt: skip
    build = time.perf_counter() - t0
    params = SamplingParams(max_tokens=run.workload.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = run.workload.prompts()
    tokens: list[list[int]] = []
    ttft: list[float] = []
    cached: list[int] = []
    t0 = time.perf_counter()
    size = run.workload.round_size
    for start in range(0, len(prompts), size):
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts[start : start + size]]
        for out in llm.generate(batch, params, use_tqdm=False):
            tokens.append(list(out.outputs[0].token_ids))
            cached.append(int(out.num_cached_tokens or 0))
            latency = getattr(out.metrics, "first_token_latency", None)  # seconds
            if latency:
                ttft.append(float(latency))
    seconds = time.perf_counter() - t0
    result: dict[str, Any] = {
        "build_seconds": build, "seconds": seconds, "tokens": tokens, "ttft": ttft,
        "cached_tokens": cached, "prompt_tokens": sum(len(p) for p in prompts),
    }  # fmt: skip
    if run.probes:
        probes = [TokensPrompt(prompt_token_ids=p) for p in probe_prompts()]
        result["probes"] = [list(o.outputs[0].token_ids)
                            for o in llm.generate(probes, params, use_tqdm=False)]
    result["metrics"] = _metrics(llm)
    return result


def run_in_subprocess(run: Run, workdir: Path, *, timeout: float = 900) -> dict[str, Any]:
    """``run`` in a fresh Python process (this checkout on its path); its result."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    workdir.mkdir(parents=True, exist_ok=True)
    spec_file = workdir / f"run-{time.monotonic_ns()}.json"
    spec_file.write_text(json.dumps(asdict(run)))
    env = {**os.environ, **ENGINE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations.vllm.engine", str(spec_file)],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    out_file = spec_file.with_suffix(".out.json")
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(
            f"engine run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-6000:]}"
        )
    result: dict[str, Any] = json.loads(out_file.read_text())
    result["log"] = proc.stderr[-20000:]
    return result


def _main(path: str) -> None:
    raw = json.loads(Path(path).read_text())
    workload = raw.pop("workload")
    workload["question_tokens"] = tuple(workload["question_tokens"])
    run = Run(workload=Workload(**workload), **raw)
    result = run_engine(run)
    Path(path).with_suffix(".out.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1])
