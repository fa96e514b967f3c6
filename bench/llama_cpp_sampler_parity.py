"""Parity of the sampler's llama.cpp chain with llama.cpp's own samplers (through llama-cpp-python)
on the same logits: the same kept-token sets, logits and probabilities, sampler by sampler and chained.

Two halves in one file. `peer` runs under a Python that has llama_cpp (the peers venv; needs only
numpy and ctypes): it applies llama.cpp's samplers to each row of an .npy of logits and writes the
survivors. `compare` (our .venv) runs model_worker.sampling's Sampler with sampler_order=llama.cpp on
the same logits, starts the peer half as a subprocess, and reports per case; tests/
test_sampling_llama_cpp_python.py asserts on those reports.

    .venv/bin/python bench/llama_cpp_sampler_parity.py compare --peer-python /work/peers-venv/bin/python
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# llama.cpp's default chain (common_params_sampling::samplers, which llama-server and llama-cli use):
# penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature; then dist draws.
LLAMA_CPP_DEFAULT_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typical", "top_p", "min_p", "xtc", "temp")
MIN_KEEP = 1  # what our filters guarantee: the most likely token always survives
SEED = 1234
PEER_ENV = "TOKENWIRE_LLAMA_CPP_PYTHON"
PEER_DEFAULTS = (Path("/work/peers-venv/bin/python"), Path.home() / ".cache/tokenwire/peers-venv/bin/python")

# Tolerances of the comparison, as the HF parity test uses for logits; probabilities are compared
# absolutely (they are <= 1; llama.cpp normalises with a double sum, we in float32).
LOGIT_RTOL = 1e-5
LOGIT_ATOL = 1e-5
PROB_ATOL = 5e-5
# llama.cpp's top-p and typical add up float32 probabilities normalised by a float32 sum over the
# vocabulary (sequentially), which drifts by up to ~1e-3 on a flat 49k-token row: a cut whose exact
# mass is that close to p can land a token or two away. Such a row is accepted only when ours is the
# float64 answer and llama.cpp's kept mass (in float64) is within this of the threshold.
BOUNDARY_TOL = 1e-3


# ---------------------------------------------------------------------------------------------
# The cases: one llama.cpp chain and the SamplingParams that should do the same.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    llama: tuple[tuple[str, dict], ...]  # llama.cpp samplers in chain order (dist is appended)
    ours: dict = field(default_factory=dict)  # SamplingParams fields (sampler_order=llama.cpp added)
    prompt: tuple[int, ...] = (0,)
    output: tuple[int, ...] = ()
    # Tokens llama.cpp's chain accepts before applying (its penalties/DRY history); None: prompt + output.
    history: tuple[int, ...] | None = None
    # Mirostat v2: the rows are consecutive steps of one chain (its mu carries over); ours replays
    # llama.cpp's drawn token at each step.
    sequential: bool = False
    # (filter, threshold) when the case is top-p or typical alone: its cut may be checked in float64.
    mass_cut: tuple[str, float] | None = None

    def to_job(self) -> dict:
        history = list(self.prompt + self.output) if self.history is None else list(self.history)
        samplers = [[name, params] for name, params in self.llama]
        if not self.sequential:
            samplers.append(["dist", {"seed": SEED}])  # llama.cpp's own probabilities of the survivors
        return {"name": self.name, "samplers": samplers, "history": history, "sequential": self.sequential}


def _chain(**params) -> tuple[tuple[str, dict], ...]:
    """llama.cpp samplers for the given settings, in llama.cpp's default order."""
    by_name = {
        "penalties": ("penalties", params.get("penalties")),
        "dry": ("dry", params.get("dry")),
        "top_n_sigma": ("top_n_sigma", {"n": params["top_n_sigma"]} if "top_n_sigma" in params else None),
        "top_k": ("top_k", {"k": params["top_k"]} if "top_k" in params else None),
        "typical": ("typical", {"p": params["typical_p"], "min_keep": MIN_KEEP} if "typical_p" in params else None),
        "top_p": ("top_p", {"p": params["top_p"], "min_keep": MIN_KEEP} if "top_p" in params else None),
        "min_p": ("min_p", {"p": params["min_p"], "min_keep": MIN_KEEP} if "min_p" in params else None),
        "xtc": ("xtc", {"p": 1.0, "t": params["xtc_threshold"], "min_keep": MIN_KEEP, "seed": SEED}
                if "xtc_threshold" in params else None),
        "temp": ("temp", {"t": params["temperature"]} if "temperature" in params else None),
    }
    return tuple((name, p) for name, p in (by_name[k] for k in LLAMA_CPP_DEFAULT_ORDER) if p is not None)


def _filter_case(name: str, temperature: float = 1.0, **filters) -> Case:
    ours = dict(filters, temperature=temperature)
    if "xtc_threshold" in filters:
        ours["xtc_probability"] = 1.0  # the coin always comes up: deterministic on both sides
    (only, threshold), = filters.items() if len(filters) == 1 else ((None, None),)
    mass_cut = (only, threshold) if only in ("top_p", "typical_p") and temperature == 1.0 else None
    return Case(name, _chain(temperature=temperature, **filters), ours, mass_cut=mass_cut)


def default_cases(logits: np.ndarray) -> list[Case]:
    """The cases for logits [R, V]: each filter alone, the penalties with a history drawn from the
    rows' likely tokens (so they change what survives), and whole chains in llama.cpp's order."""
    per_row = max(12, -(-72 // logits.shape[0]))  # enough distinct tokens for the histories below
    top = np.argsort(-logits, axis=-1)[:, :per_row]  # [R, per_row] each row's likeliest tokens
    likely = [int(t) for t in dict.fromkeys(top.T.reshape(-1).tolist())]  # interleaved over rows
    prompt = tuple(likely[:6] + likely[20:26])  # 12 tokens
    output = tuple(likely[3:9] + likely[26:32] + likely[3:7] + likely[40:44])  # 20, with repeats
    pen = {"last_n": 64, "repeat": 1.3, "freq": 0.0, "present": 0.0}
    cases = [
        _filter_case("temperature_0.7", temperature=0.7),
        _filter_case("top_k_1", top_k=1),
        _filter_case("top_k_40", top_k=40),
        _filter_case("top_p_0.9", top_p=0.9),
        _filter_case("top_p_0.5", top_p=0.5),
        _filter_case("min_p_0.05", min_p=0.05),
        _filter_case("min_p_0.2", min_p=0.2),
        _filter_case("typical_p_0.9", typical_p=0.9),
        _filter_case("typical_p_0.5", typical_p=0.5),
        _filter_case("top_n_sigma_1", top_n_sigma=1.0),
        _filter_case("top_n_sigma_2.5", top_n_sigma=2.5),
        _filter_case("xtc_0.1", xtc_threshold=0.1),
        _filter_case("xtc_0.02", xtc_threshold=0.02),
        # llama.cpp's repeat penalty over a window (last_n 8 < history 32: older tokens fall out).
        Case("repeat_penalty_last_8", _chain(penalties=dict(pen, last_n=8), temperature=1.0),
             {"temperature": 1.0, "repeat_penalty": 1.3, "penalty_last_n": 8}, prompt, output),
        Case("repeat_penalty_last_64", _chain(penalties=pen, temperature=1.0),
             {"temperature": 1.0, "repeat_penalty": 1.3, "penalty_last_n": 64}, prompt, output),
        # Deliberate difference: llama.cpp counts frequency/presence over its last_n window of prompt
        # + output, ours are OpenAI's (every output token, no prompt). They coincide when llama.cpp's
        # history is the output alone and its window holds all of it, which is what is compared.
        Case("frequency_presence", _chain(penalties=dict(pen, repeat=1.0, freq=0.4, present=0.6), temperature=1.0),
             {"temperature": 1.0, "frequency_penalty": 0.4, "presence_penalty": 0.6}, prompt, output,
             history=output),
        # All three: the prompt is one token that the output repeats, so the repeat penalty's window
        # (ours: prompt + output) holds the same token set as llama.cpp's (output only).
        Case("repeat_frequency_presence", _chain(penalties=dict(pen, freq=0.4, present=0.6), temperature=1.0),
             {"temperature": 1.0, "repeat_penalty": 1.3, "penalty_last_n": 64, "frequency_penalty": 0.4,
              "presence_penalty": 0.6}, output[:1], output, history=output),
    ]
    # DRY: a history that repeats a 5-token run, so the token that continued it is penalised.
    run = tuple(likely[:5])
    dry_history = tuple(likely[50:58]) + run + (likely[60],) + tuple(likely[61:64]) + run[:4]
    for name, breakers in (("dry", ()), ("dry_breaker", ((run[1],),)), ("dry_breaker_seq", ((run[0], run[1]),))):
        dry = {"multiplier": 0.8, "base": 1.75, "allowed_length": 2, "last_n": 64,
               "breakers": [list(b) for b in breakers]}
        cases.append(Case(name, _chain(dry=dry, temperature=1.0),
                          {"temperature": 1.0, "dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2,
                           "dry_penalty_last_n": 64, "dry_sequence_breakers": breakers},
                          dry_history[:1], dry_history[1:]))
    full = {"top_k": 40, "typical_p": 0.95, "top_p": 0.9, "min_p": 0.05, "temperature": 0.8}
    cases += [
        _filter_case("chain_k_typ_p_minp_temp", **full),
        _filter_case("chain_sigma_k_p_temp", top_n_sigma=1.5, top_k=100, top_p=0.95, temperature=0.7),
        _filter_case("chain_all_filters_xtc", top_n_sigma=2.0, xtc_threshold=0.05, **full),
        Case("chain_penalties_dry_filters",
             _chain(penalties=dict(pen, last_n=16), dry={"multiplier": 0.8, "base": 1.75, "allowed_length": 2,
                                                         "last_n": 64, "breakers": []}, **full),
             dict(full, repeat_penalty=1.3, penalty_last_n=16, dry_multiplier=0.8, dry_base=1.75,
                  dry_allowed_length=2, dry_penalty_last_n=64), dry_history[:1], dry_history[1:]),
        # Mirostat v2 as llama.cpp's common chain builds it (temperature, then mirostat_v2 draws).
        Case("mirostat_v2", (("temp", {"t": 0.9}), ("mirostat_v2", {"seed": SEED, "tau": 3.0, "eta": 0.5})),
             {"temperature": 0.9, "mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.5}, sequential=True),
    ]
    return cases


# ---------------------------------------------------------------------------------------------
# The peer half: llama.cpp's samplers through llama-cpp-python's low-level ctypes API.
# ---------------------------------------------------------------------------------------------

def _std_vector_of_vectors(seqs: list[list[int]]) -> tuple[ctypes.Structure, list]:
    """A std::vector<std::vector<int32_t>> laid out as libstdc++ does (begin, end, capacity
    pointers), for llama_sampler_init_dry_testing's const reference. Returns it and the buffers
    it points into (keep them alive while it is used)."""

    class Vec(ctypes.Structure):
        _fields_ = [("begin", ctypes.c_void_p), ("end", ctypes.c_void_p), ("cap", ctypes.c_void_p)]

    keep: list = []
    inner = (Vec * max(len(seqs), 1))()
    for i, seq in enumerate(seqs):
        buf = (ctypes.c_int32 * len(seq))(*seq)
        keep.append(buf)
        start = ctypes.addressof(buf)
        inner[i] = Vec(start, start + 4 * len(seq), start + 4 * len(seq))
    keep.append(inner)
    start = ctypes.addressof(inner)
    outer = Vec(start, start + ctypes.sizeof(Vec) * len(seqs), start + ctypes.sizeof(Vec) * len(seqs))
    return outer, keep


class UnsupportedSampler(Exception):
    """This llama_cpp build cannot run the sampler as the case needs it."""


# llama.cpp's DRY test entry point, C++ (mangled): (multiplier, base, allowed_length, last_n,
# breakers) in recent builds, with a leading int context_size in older ones.
_DRY_TESTING = {
    "_Z30llama_sampler_init_dry_testingffiiRKSt6vectorIS_IiSaIiEESaIS1_EE": False,
    "_Z30llama_sampler_init_dry_testingiffiiRKSt6vectorIS_IiSaIiEESaIS1_EE": True,
}


def _init_dry(llama_cpp, p: dict):
    """DRY without a model: llama_sampler_init_dry needs a llama_vocab to tokenize string breakers;
    llama.cpp's test wrapper llama_sampler_init_dry_testing (exported C++ symbol) takes token-id
    breakers instead, which is also what our SamplingParams carry."""
    lib = llama_cpp.llama_cpp._lib
    for symbol, takes_context_size in _DRY_TESTING.items():
        try:
            fn = lib[symbol]
        except AttributeError:
            continue
        fn.restype = llama_cpp.llama_sampler_p_ctypes
        head = [ctypes.c_int32] if takes_context_size else []
        fn.argtypes = [*head, ctypes.c_float, ctypes.c_float, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]
        outer, keep = _std_vector_of_vectors(p["breakers"])
        context = [1 << 20] if takes_context_size else []  # only bounds last_n = -1, not used here
        sampler = fn(*context, p["multiplier"], p["base"], p["allowed_length"], p["last_n"], ctypes.addressof(outer))
        del keep  # the wrapper copied the breakers
        return sampler
    raise UnsupportedSampler("this libllama exports no llama_sampler_init_dry_testing with token-id breakers")


def _init_sampler(llama_cpp, name: str, p: dict, vocab_size: int):
    if name == "penalties":
        args = (p["last_n"], p["repeat"], p["freq"], p["present"])
        if len(llama_cpp.llama_sampler_init_penalties.argtypes) == 5:  # older llama.h: n_vocab first
            args = (vocab_size, *args)
        return llama_cpp.llama_sampler_init_penalties(*args)
    if name == "dry":
        return _init_dry(llama_cpp, p)
    simple = {
        "top_k": lambda: llama_cpp.llama_sampler_init_top_k(p["k"]),
        "top_p": lambda: llama_cpp.llama_sampler_init_top_p(p["p"], p["min_keep"]),
        "min_p": lambda: llama_cpp.llama_sampler_init_min_p(p["p"], p["min_keep"]),
        "typical": lambda: llama_cpp.llama_sampler_init_typical(p["p"], p["min_keep"]),
        "temp": lambda: llama_cpp.llama_sampler_init_temp(p["t"]),
        "xtc": lambda: llama_cpp.llama_sampler_init_xtc(p["p"], p["t"], p["min_keep"], p["seed"]),
        "top_n_sigma": lambda: llama_cpp.llama_sampler_init_top_n_sigma(p["n"]),
        "mirostat_v2": lambda: llama_cpp.llama_sampler_init_mirostat_v2(p["seed"], p["tau"], p["eta"]),
        "dist": lambda: llama_cpp.llama_sampler_init_dist(p["seed"]),
    }
    return simple[name]()


_QUIET_LOG = None
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data


def _apply(llama_cpp, chain, row: np.ndarray) -> tuple[np.ndarray, int]:
    """Applies the chain to one row of logits [V] -> (the surviving llama_token_data, selected)."""
    buf = np.zeros(row.shape[0], dtype=TOKEN_DATA)
    buf["id"] = np.arange(row.shape[0], dtype=np.int32)
    buf["logit"] = row
    arr = llama_cpp.llama_token_data_array(
        data=ctypes.cast(buf.ctypes.data, llama_cpp.llama_token_data_p), size=row.shape[0], selected=-1,
        sorted=False)
    llama_cpp.llama_sampler_apply(chain, ctypes.byref(arr))
    # XTC advances `data` past the tokens it drops, so read through the array's own pointer.
    start = (ctypes.cast(arr.data, ctypes.c_void_p).value - buf.ctypes.data) // TOKEN_DATA.itemsize
    return buf[start:start + arr.size].copy(), int(arr.selected)


def run_peer(job_path: Path, out_path: Path) -> None:
    import llama_cpp

    global _QUIET_LOG  # the callback must outlive the call that installs it
    _QUIET_LOG = llama_cpp.llama_log_callback(lambda *_: None)
    llama_cpp.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))
    job = json.loads(job_path.read_text())
    logits = np.load(job["logits"]).astype(np.float32)  # [R, V]
    out: dict[str, np.ndarray] = {}

    def new_chain(case: dict):
        params = llama_cpp.llama_sampler_chain_default_params()
        params.no_perf = True
        chain = llama_cpp.llama_sampler_chain_init(params)
        for name, p in case["samplers"]:
            llama_cpp.llama_sampler_chain_add(chain, _init_sampler(llama_cpp, name, p, logits.shape[1]))
        for token in case["history"]:
            llama_cpp.llama_sampler_accept(chain, token)
        return chain

    for case in job["cases"]:
        try:
            llama_cpp.llama_sampler_free(new_chain(case))
        except UnsupportedSampler as e:
            out[f"{case['name']}/unsupported"] = np.array([str(e)])
            continue
        chain = new_chain(case) if case["sequential"] else None
        for r in range(logits.shape[0]):
            if not case["sequential"]:
                chain = new_chain(case)
            data, selected = _apply(llama_cpp, chain, logits[r])
            for key in ("id", "logit", "p"):
                out[f"{case['name']}/{r}/{key}"] = data[key]
            out[f"{case['name']}/{r}/selected"] = np.array([data["id"][selected] if selected >= 0 else -1])
            if case["sequential"]:
                llama_cpp.llama_sampler_accept(chain, int(data["id"][selected]))
            else:
                llama_cpp.llama_sampler_free(chain)
        if case["sequential"]:
            llama_cpp.llama_sampler_free(chain)
    out["version"] = np.array([llama_cpp.__version__])
    np.savez(out_path, **out)


# ---------------------------------------------------------------------------------------------
# Our half: the Sampler on the same logits, and the comparison.
# ---------------------------------------------------------------------------------------------

@dataclass
class CaseReport:
    name: str
    kept_llama: list[int]  # per row, tokens left by llama.cpp
    kept_ours: list[int]
    max_logit_err: float  # over tokens both keep
    max_prob_err: float
    mismatches: list[str]  # kept-set or value differences, one line each
    rounding_rows: list[int] = field(default_factory=list)  # rows let through by _rounding_cut
    # Kept tokens whose llama.cpp logit is not the input's: shows a penalty or DRY did something.
    num_changed: int = 0
    unsupported: str | None = None  # why llama.cpp's side could not run (nothing was compared)


def find_peer_python() -> str | None:
    """The Python with llama_cpp: $TOKENWIRE_LLAMA_CPP_PYTHON, else a peers venv that exists and
    imports it; None when there is none."""
    candidates = [os.environ[PEER_ENV]] if os.environ.get(PEER_ENV) else [str(p) for p in PEER_DEFAULTS]
    for python in candidates:
        if not Path(python).exists():
            continue
        check = subprocess.run([python, "-c", "import llama_cpp, numpy"], capture_output=True, timeout=120)
        if check.returncode == 0:
            return python
    return None


def run_llama_cpp(peer_python: str, logits: np.ndarray, cases: list[Case], workdir: Path) -> dict[str, np.ndarray]:
    logits_path, job_path, out_path = workdir / "logits.npy", workdir / "job.json", workdir / "llama_cpp.npz"
    np.save(logits_path, logits.astype(np.float32))
    job_path.write_text(json.dumps({"logits": str(logits_path), "cases": [c.to_job() for c in cases]}))
    subprocess.run([peer_python, str(Path(__file__).resolve()), "peer", "--job", str(job_path), "--out",
                    str(out_path)], check=True, timeout=600)
    with np.load(out_path) as data:
        return dict(data)


def _our_rows(case: Case, logits, llama_out: dict[str, np.ndarray]):
    """[R, V] float32 logits our sampler would draw from for the case."""
    import torch

    from model_worker.sampling import Sampler, processors
    from model_worker.sequence import SamplerOrder, SamplingParams, Sequence

    params = SamplingParams(sampler_order=SamplerOrder.LLAMA_CPP, **case.ours)
    if case.sequential:  # mirostat v2: temperature, then truncation at surprise mu; replay llama.cpp's draws
        rows = []
        mu = torch.tensor([[2.0 * params.mirostat_tau]])
        tau, eta = torch.tensor([[params.mirostat_tau]]), torch.tensor([[params.mirostat_eta]])
        for r in range(logits.shape[0]):
            x = processors.apply_temperature(logits[r:r + 1].clone(), torch.tensor([[params.temperature]]))
            x = processors.mirostat_v2(x, mu)
            chosen = int(llama_out[f"{case.name}/{r}/selected"][0])
            mu = processors.mirostat_v2_update(mu, x.log_softmax(-1)[:, chosen:chosen + 1], tau, eta)
            rows.append(x)
        return torch.cat(rows)
    seqs = [Sequence(seq_id=i, prompt_token_ids=list(case.prompt), sampling=params, max_tokens=16,
                     stop_token_ids=frozenset(), output_token_ids=list(case.output)) for i in range(logits.shape[0])]
    return Sampler(logits.shape[1], torch.device("cpu")).processed_logits(logits.clone(), seqs)


def _rounding_cut(row: np.ndarray, mass_cut: tuple[str, float], kept_ours: set[int], kept_theirs: set[int]) -> bool:
    """Whether a top-p / typical kept-set difference is llama.cpp's float32 rounding at the cut:
    ours is the float64 answer and llama.cpp's set holds a mass within BOUNDARY_TOL of the threshold."""
    name, threshold = mass_cut
    x = row.astype(np.float64)
    log_p = x - x.max() - np.log(np.exp(x - x.max()).sum())
    p = np.exp(log_p)
    if name == "top_p":
        order = np.argsort(-x, kind="stable")
    else:
        entropy = -(p * log_p).sum()
        order = np.argsort(np.abs(-log_p - entropy), kind="stable")
    cum = np.cumsum(p[order])
    # top-p keeps up to the first token whose cumulative mass reaches p, typical past it (> p).
    first = int(np.searchsorted(cum, threshold, side="left" if name == "top_p" else "right"))
    exact = set(order[:first + 1].tolist())
    theirs_mass = float(p[sorted(kept_theirs)].sum())
    return kept_ours == exact and abs(theirs_mass - threshold) <= BOUNDARY_TOL


def compare(logits: np.ndarray, cases: list[Case], peer_python: str) -> list[CaseReport]:
    import torch

    with tempfile.TemporaryDirectory(prefix="llama-cpp-parity-") as tmp:
        llama_out = run_llama_cpp(peer_python, logits, cases, Path(tmp))
    x = torch.from_numpy(logits.astype(np.float32))
    reports = []
    for case in cases:
        if f"{case.name}/unsupported" in llama_out:
            reports.append(CaseReport(case.name, [], [], 0.0, 0.0, [],
                                      unsupported=str(llama_out[f"{case.name}/unsupported"][0])))
            continue
        ours = _our_rows(case, x, llama_out)
        probs = ours.softmax(dim=-1)
        report = CaseReport(case.name, [], [], 0.0, 0.0, [])
        for r in range(x.shape[0]):
            ids = llama_out[f"{case.name}/{r}/id"]
            their_logits = llama_out[f"{case.name}/{r}/logit"]
            their_p = llama_out[f"{case.name}/{r}/p"]
            alive = their_logits > -np.inf  # top-n-sigma marks tokens -inf instead of dropping them
            report.num_changed += int((their_logits[alive] != logits[r, ids[alive]]).sum())
            kept_theirs = set(ids[alive].tolist())
            kept_ours = set(torch.isfinite(ours[r]).nonzero()[:, 0].tolist())
            report.kept_llama.append(len(kept_theirs))
            report.kept_ours.append(len(kept_ours))
            if kept_theirs != kept_ours and case.mass_cut and _rounding_cut(logits[r], case.mass_cut, kept_ours,
                                                                            kept_theirs):
                report.rounding_rows.append(r)
                continue
            if kept_theirs != kept_ours:
                only_theirs, only_ours = sorted(kept_theirs - kept_ours), sorted(kept_ours - kept_theirs)
                report.mismatches.append(f"row {r}: kept {len(kept_ours)} (ours) vs {len(kept_theirs)} (llama.cpp); "
                                         f"only llama.cpp {only_theirs[:8]}, only ours {only_ours[:8]}")
                continue
            both = torch.from_numpy(ids[alive].astype(np.int64))
            mine, theirs = ours[r, both].double(), torch.from_numpy(their_logits[alive]).double()
            report.max_logit_err = max(report.max_logit_err, float((mine - theirs).abs().max()))
            if not torch.allclose(mine, theirs, rtol=LOGIT_RTOL, atol=LOGIT_ATOL):
                worst = int((mine - theirs).abs().argmax())
                report.mismatches.append(f"row {r}: logit of token {int(both[worst])} is {float(mine[worst])} "
                                         f"(ours) vs {float(theirs[worst])} (llama.cpp)")
            p_err = float((probs[r, both].double() - torch.from_numpy(their_p[alive]).double()).abs().max())
            report.max_prob_err = max(report.max_prob_err, p_err)
            if p_err > PROB_ATOL:
                report.mismatches.append(f"row {r}: probabilities differ by up to {p_err:.3g}")
        reports.append(report)
    return reports


def smollm2_logits(model_dir: Path, prompts: list[str], positions: int) -> np.ndarray:
    """[len(prompts) * positions, V]: SmolLM2's float32 logits at each prompt's last positions."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt).ids])
            rows.append(model(ids).logits[0, -positions:].float())
    return torch.cat(rows).numpy()


PROMPTS = (
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\nThe sea is",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nThe capital",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
)


def synthetic_logits(vocab_size: int = 49152, seed: int = 0) -> np.ndarray:
    """[6, V] float32: random rows shaped like a vocabulary at several sharpnesses, plus crafted
    ones (a few close favourites, for XTC and top-n-sigma; one dominant token)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((6, vocab_size)).astype(np.float32)
    rows = [base[0] * 2.0, base[1] * 4.0, base[2] * 1.0]
    close = base[3] * 1.5
    close[rng.choice(vocab_size, 5, replace=False)] = np.float32([14.0, 13.6, 13.3, 12.9, 12.2])
    dominant = base[4] * 1.5
    dominant[rng.integers(vocab_size)] = 20.0
    # A heavy tail squashed by a log (clipping would make exact ties, which top-k breaks arbitrarily).
    tail = rng.standard_cauchy(vocab_size)
    heavy_tail = (3.0 * np.sign(tail) * np.log1p(np.abs(tail))).astype(np.float32)
    return np.stack(rows + [close, dominant, heavy_tail]).astype(np.float32)


def _print_reports(title: str, reports: list[CaseReport]) -> bool:
    print(f"\n{title}\n\n| case | kept per row (ours = llama.cpp) | logits changed | max logit err | max p err "
          "| result |")
    print("|---|---|---:|---:|---:|---|")
    ok = True
    for rep in reports:
        ok &= not rep.mismatches
        kept = ",".join(str(k) for k in rep.kept_llama)
        result = "DIFFER" if rep.mismatches else "match" if not rep.unsupported else f"not run: {rep.unsupported}"
        if rep.rounding_rows and not rep.mismatches:
            result += f" (rows {rep.rounding_rows}: llama.cpp's float32 cut, ours = float64)"
        print(f"| {rep.name} | {kept} | {rep.num_changed} | {rep.max_logit_err:.2g} | {rep.max_prob_err:.2g} "
              f"| {result} |")
        for line in rep.mismatches[:4]:
            print(f"|   | {line} | | | | |")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    peer = sub.add_parser("peer", help="llama.cpp's half (run under the Python that has llama_cpp)")
    peer.add_argument("--job", type=Path, required=True)
    peer.add_argument("--out", type=Path, required=True)
    cmp = sub.add_parser("compare", help="our half: run both and compare")
    cmp.add_argument("--peer-python", default=None, help=f"default: ${PEER_ENV} or a peers venv")
    cmp.add_argument("--model-dir", type=Path, default=None, help="converted SmolLM2 (default: the tests' cache)")
    cmp.add_argument("--no-model", action="store_true", help="synthetic logits only")
    args = parser.parse_args()
    if args.command == "peer":
        run_peer(args.job, args.out)
        return
    peer_python = args.peer_python or find_peer_python()
    if peer_python is None:
        sys.exit(f"no Python with llama_cpp found (set {PEER_ENV}, or run `make bench-peers`)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    logits = synthetic_logits()
    ok = _print_reports("synthetic logits [6, 49152]", compare(logits, default_cases(logits), peer_python))
    if not args.no_model:
        model_dir = args.model_dir
        if model_dir is None:
            from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir

            cache = Path(os.environ.get("TOKENWIRE_CACHE_DIR", Path.home() / ".cache" / "tokenwire"))
            model_dir = resolve_model_dir(DEFAULT_MODEL, cache)
        logits = smollm2_logits(model_dir, list(PROMPTS), positions=3)
        ok &= _print_reports(f"SmolLM2 logits {list(logits.shape)}", compare(logits, default_cases(logits),
                                                                           peer_python))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
