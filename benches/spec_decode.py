"""Speculative decoding against plain decoding at a set mean acceptance length, on a bundled config with random
weights (GPU; not a test).

Random weights give nearly flat logits, whose argmax the numerics of a step flip (a verify step's k + 1 query tokens
against a decode step's one, in bfloat16), so the target is first given a peaked greedy continuation
(`peak_greedy`): the token after t is always next_token[t], by a margin of sqrt(hidden_size) standard deviations of
the other logits. Every layer still computes on random weights, so the cost of a step is unchanged.

A first pass records the target's own greedy continuation of every prompt with plain decoding (it must be the
chain of next_token: checked); the timed spec run then proposes from that recording through `ReplayProposer` (a
proposer of this bench only, never of the package), which corrupts one proposed token a step so that on average
`--acceptance-length - 1` proposals are accepted: the verify step's cost is measured at a known acceptance,
independent of how well n-grams would guess. Greedy outputs must match the recording token for token (checked).
Per batch size: plain decoding with async scheduling (the engine's default on CUDA), plain decoding synchronous
(what speculation gives up), and speculation, with the graphs a verify step and a decode step replay.

    PYTHONPATH=. python benches/spec_decode.py --model llama-3.1-8b --batch-sizes 1 8 32 -k 4 --acceptance-length 3.0 \
        [--verify-buckets on off] [--profile 20] [--async-spec]

`--async-spec` also times speculation under async scheduling (the engine's default on CUDA for n-gram proposals),
whose proposals are made on the device: `DeviceReplay` proposes the peaked chain there, corrupted the same way.

`--draft CONFIG` runs a draft model (a bundled config, random weights) instead of the replayed proposals and
reports the cost of a draft call (catch-up and k greedy tokens) and of a verify step, synchronous; both models are
peaked to the identity chain (the token after t is t), so every proposal is accepted and the tokens are checked.
With `--async-spec` the draft model then also runs under async scheduling (its steps launched from the target's
table on the device, `spec_decode/draft_device.py`), timed whole:

    PYTHONPATH=. python benches/spec_decode.py --model llama-3.1-8b --draft llama-3.2-1b --batch-sizes 1 8 -k 4 \
        --prompt-len 256 --output-len 128 [--async-spec]

On a CPU (the acceptance and the token match, not the speed), a 4-layer Qwen3-0.6B in bfloat16:

    PYTHONPATH=. python benches/spec_decode.py --model qwen3-0.6b --num-layers 4 --device cpu --dtype bfloat16 \
        --batch-sizes 1 4 --prompt-len 32 --output-len 64 --acceptance-length 2.5
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import ember.graphs.dispatcher as dispatcher_module
from ember import LLM, SamplingParams
from ember.bench.commands import profile_workload, release_engine
from ember.models.bundled import CONFIG_DIR
from ember.models.layers.embedding import LMHead, VocabEmbedding

# the embeddings' RMS after `peak_greedy`: random layers (std-0.02 weights on RMS-normed inputs) add to the residual
# stream about 2.6 RMS a layer for the Llama-3.1-8B config (5.15 over its first 4 layers, bf16 on a CPU), so about
# 15 over its 32 layers, 1.5% of this; Qwen3-0.6B's 28 layers add 3.1
EMBEDDING_RMS = 1000.0


@torch.no_grad()
def peak_greedy(model: torch.nn.Module, seed: int = 0, identity: bool = False) -> torch.Tensor:
    """Set a randomly initialised model's embeddings and LM head so that greedy decoding emits next_token[t] after
    token t whatever came before, by a wide margin; returns next_token [V] (int64, on the CPU).

    The embeddings are scaled to an RMS of `EMBEDDING_RMS`, so the residual stream stays the last token's
    embedding: every layer reads it through an RMSNorm (scale-free: the layers compute what they did) and adds a
    small fraction to it. The final norm is at identity (random init), so the LM head sees the embedding's
    direction. An untied head's row next_token[t] becomes token t's embedding direction (at the init's scale):
    that logit is sqrt(hidden_size) standard deviations of the others above them. A tied head is the embedding,
    so next_token is the identity; `identity` makes it the identity for an untied head too (a tied draft model
    then proposes the target's chain)."""
    embed = [m for m in model.modules() if isinstance(m, VocabEmbedding)]
    head = [m for m in model.modules() if isinstance(m, LMHead)]
    if len(embed) != 1 or len(head) != 1 or embed[0].tp_size != 1:
        raise ValueError(f"peak_greedy needs one embedding and one LM head on one rank; found {len(embed)} "
                         f"embeddings and {len(head)} heads")
    embed, head = embed[0], head[0]
    weight = embed.weight                                                           # [V, hidden]
    vocab = weight.shape[0]
    std = None if head.tied else float(head.weight[:4096].float().std())
    next_token = (torch.arange(vocab) if head.tied or identity
                  else torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)))
    for start in range(0, vocab, 4096):       # a few rows at a time: the KV cache holds most of the GPU's memory
        rows = weight[start:start + 4096].float()
        direction = rows / rows.pow(2).mean(dim=1, keepdim=True).sqrt()             # unit RMS rows
        weight[start:start + 4096] = direction * EMBEDDING_RMS
        if std is not None:
            head.weight[next_token[start:start + 4096].to(weight.device)] = (direction * std).to(head.weight.dtype)
    if head.packed_weight is not None:           # oneDNN's copy (float32 on a CPU) follows the new weight
        from ember.models.layers.onednn import pack_weight
        head.packed_weight = pack_weight(head.weight_to_pack())
    return next_token


def greedy_chain(last: int, next_token: list[int], length: int) -> list[int]:
    """The `length` tokens greedy decoding emits after `last` on a model given `next_token` by `peak_greedy`."""
    out = []
    for _ in range(length):
        last = next_token[last]
        out.append(last)
    return out


def model_path(name: str, num_layers: int | None, folder: str) -> str:
    """The bundled config `name`, or a folder holding it with `num_layers` decoder layers (random weights either
    way)."""
    if num_layers is None:
        return name
    values = json.loads((CONFIG_DIR / f"{name.lower()}.json").read_text())
    values["num_hidden_layers"] = num_layers
    (Path(folder) / "config.json").write_text(json.dumps(values))
    return folder


class ReplayProposer:
    """Proposes the recorded continuation of the request whose prompt starts a sequence, with the proposal after
    the first m replaced by a wrong one. m is the floor or the ceiling of `mean_accepted`, carried over from call to
    call (error diffusion) so that the run's mean is `mean_accepted` to within one token over the run's steps:
    random draws would miss it by their standard error (0.1 over 25 steps at a mean of 1.5)."""

    def __init__(self, recorded: dict[tuple[int, ...], list[int]], k: int, mean_accepted: float, vocab: int,
                 key_len: int):
        if not 0 <= mean_accepted <= k:
            raise ValueError(f"mean accepted proposals {mean_accepted} is outside 0..k={k}; ask for an acceptance "
                             f"length from 1 to k + 1")
        self.recorded, self.k, self.mean, self.vocab, self.key_len = recorded, k, mean_accepted, vocab, key_len
        self.carry = 0.0

    def propose(self, token_ids: np.ndarray, max_len: int) -> np.ndarray:
        seq = self.recorded[tuple(token_ids[:self.key_len].tolist())]
        n = token_ids.shape[0]
        out = list(seq[n:n + min(self.k, max_len)])
        self.carry += self.mean
        m = int(self.carry)
        self.carry -= m
        if m < len(out):
            out[m] = (out[m] + 1) % self.vocab
        return np.asarray(out, dtype=np.int64)


def timed(llm, prompts, params) -> tuple[float, list[list[int]]]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def spec_timed(spec, prompts, params, expected) -> tuple[float, dict]:
    """`timed` on a speculating engine: (seconds, the run's figures: tokens/s, whether every output equals
    `expected(prompt)`, the acceptance rate, the mean acceptance length and the steps, from the engine's counters
    over the run)."""
    s = spec.engine.stats
    drafted, accepted, verified, steps = s.num_draft_tokens, s.num_accepted_tokens, s.num_verified_requests, s.num_steps
    elapsed, outs = timed(spec, prompts, params)
    accepted = s.num_accepted_tokens - accepted
    return elapsed, {"tok_s": sum(len(o) for o in outs) / elapsed,
                     "greedy_tokens_match": all(expected(p) == o for p, o in zip(prompts, outs)),
                     "acceptance_rate": accepted / max(s.num_draft_tokens - drafted, 1),
                     "mean_acceptance_length": 1 + accepted / max(s.num_verified_requests - verified, 1),
                     "steps": s.num_steps - steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="a bundled config")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--acceptance-length", type=float, default=3.0, help="mean tokens a verify step emits")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=None, help="decoder layers (default: the config's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--verify-buckets", nargs="+", choices=["on", "off"], default=["off"],
                    help="FULL graphs of verify steps by request count (ember.graphs.dispatcher.VERIFY_BUCKETS); "
                         "'on off' runs speculation on an engine of each")
    ap.add_argument("--draft", default=None, metavar="CONFIG",
                    help="a bundled config drafting for --model (same vocabulary): times draft and verify steps")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                    help="with --draft: the target's share (the draft's cache takes what the device has left)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="then profile STEPS steps of synchronous plain decoding and of speculation at the first "
                         "batch size (host phases, device kernels and their share of the critical path)")
    ap.add_argument("--async-spec", action="store_true",
                    help="also time speculation under async scheduling, its proposals replayed on the device")
    args = ap.parse_args()
    if args.draft is not None:
        with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as draft_folder:
            draft_run(model_path(args.model, args.num_layers, folder),
                      model_path(args.draft, args.num_layers, draft_folder), args.batch_sizes,
                      args.num_speculative_tokens, args.prompt_len, args.output_len, device=args.device,
                      dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                      async_spec=args.async_spec)
        return
    with tempfile.TemporaryDirectory() as folder:
        run(model_path(args.model, args.num_layers, folder), args.batch_sizes, args.num_speculative_tokens,
            args.acceptance_length, args.prompt_len, args.output_len, args.profile,
            tuple(v == "on" for v in args.verify_buckets), args.async_spec, device=args.device, dtype=args.dtype)


def run(model: str, batch_sizes: list[int], k: int, acceptance_length: float, prompt_len: int, output_len: int,
        profile: int = 0, verify_buckets: tuple[bool, ...] = (False,), async_spec: bool = False,
        **engine_kwargs) -> list[dict]:
    """Plain decoding (async, then synchronous) and speculation at `acceptance_length` per batch size, on `model`
    with peaked random weights; prints each batch size's figures as a JSON line and returns them. A speculative
    engine for each of `verify_buckets` (FULL graphs of verify steps by request count on / off), and with
    `async_spec` one under async scheduling (proposals made on the device, `DeviceReplay`). `profile` > 0:
    then that many steps of each of the two synchronous runs at the first batch size under the profiler."""
    if not 1 <= acceptance_length <= k + 1:
        raise ValueError(f"acceptance length {acceptance_length} is outside 1..k+1={k + 1}; a verify step emits "
                         f"its accepted proposals and one more token")
    rng = np.random.default_rng(0)
    largest = max(batch_sizes)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # no prefix caching: every run prefills its prompts, as the first run of each engine does
    engine_kwargs.update(load_format="dummy", max_num_seqs=max(largest, 8), enable_prefix_caching=False)
    plain = LLM(model, **engine_kwargs)
    next_token = peak_greedy(plain.engine.runner.model).tolist()
    vocab = plain.engine.vocab_size
    prompts = [rng.integers(1, vocab, prompt_len).tolist() for _ in range(largest)]
    timed(plain, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))          # warm-up
    results, recorded = [], {}
    for b in batch_sizes:
        elapsed, outs = timed(plain, prompts[:b], params)
        off = sum(o != greedy_chain(p[-1], next_token, len(o)) for p, o in zip(prompts[:b], outs))
        if off:
            raise RuntimeError(f"batch {b}: {off} of {b} greedy outputs left the peaked chain: the model's argmax "
                               f"is not next_token[last token], so the acceptance asked for would not be the one "
                               f"measured")
        recorded.update({tuple(p): p + o for p, o in zip(prompts[:b], outs)})
        results.append({"batch": b, "plain_async_tok_s": b * output_len / elapsed})
    release_engine(plain)
    del plain
    rows = []
    default_buckets = dispatcher_module.VERIFY_BUCKETS
    for buckets in verify_buckets:
        dispatcher_module.VERIFY_BUCKETS = buckets
        # synchronous: the replayed proposals are made on the host (`async_spec_runs` times the async path)
        spec = LLM(model, **engine_kwargs, async_scheduling=False,
                   speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                       "disable_by_batch_size": max(largest, 1)})
        dispatcher_module.VERIFY_BUCKETS = default_buckets
        if peak_greedy(spec.engine.runner.model).tolist() != next_token:
            raise RuntimeError("the speculative engine's peaked chain differs from the plain engine's")
        rows += spec_runs(spec, results, buckets, prompts, recorded, params, k, acceptance_length, vocab, profile)
        release_engine(spec)
        del spec
    if async_spec:
        spec = LLM(model, **engine_kwargs, async_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                       "disable_by_batch_size": max(largest, 1)})
        if peak_greedy(spec.engine.runner.model).tolist() != next_token:
            raise RuntimeError("the speculative engine's peaked chain differs from the plain engine's")
        rows += async_spec_runs(spec, results, prompts, recorded, params, k, acceptance_length, next_token, vocab)
        release_engine(spec)
        del spec
    return rows


class DeviceReplay:
    """The async path's proposals for this bench: on the device, each row's next k tokens of the peaked chain from
    its last token, the one after m accepted ones corrupted, m drawn per row and step (floor or ceil of the mean
    asked for) so that the mean acceptance length is `mean_accepted` + 1. Replaces `DeviceVerifier.propose`."""

    def __init__(self, next_token: list[int], k: int, mean_accepted: float, vocab: int, device):
        self.next_token = torch.tensor(next_token, dtype=torch.int64, device=device)
        self.k, self.mean_accepted, self.vocab = k, mean_accepted, vocab

    def __call__(self, token_ids: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        t = token_ids[rows, counts - 1].to(torch.int64)
        chain = []
        for _ in range(self.k):
            t = self.next_token[t]
            chain.append(t)
        proposals = torch.stack(chain, dim=1)                                          # [V, k]
        low = int(self.mean_accepted)
        m = low + (torch.rand(rows.shape[0], device=rows.device) < self.mean_accepted - low).to(torch.int64)
        wrong = torch.arange(self.k, device=rows.device)[None, :] == m[:, None]
        return torch.where(wrong, (proposals + 1) % self.vocab, proposals)


def async_spec_runs(spec, plain_rows: list[dict], prompts, recorded, params, k: int, acceptance_length: float,
                    next_token: list[int], vocab: int) -> list[dict]:
    """Speculation under async scheduling (proposals and accepted counts on the device) per batch size, with
    `DeviceReplay` at `acceptance_length`; each row is `plain_rows`' row with these figures."""
    verifier = spec.engine.runner.verifier
    verifier.propose = DeviceReplay(next_token, k, acceptance_length - 1, vocab, spec.engine.runner.device)
    timed(spec, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    rows = []
    for plain in plain_rows:
        r = dict(plain, scheduling="async")
        _, run = spec_timed(spec, prompts[:r["batch"]], params, lambda p: recorded[tuple(p)][len(p):])
        r.update(run, spec_async_tok_s=run.pop("tok_s"))
        r["speedup_vs_async"] = r["spec_async_tok_s"] / r["plain_async_tok_s"]
        print(json.dumps(r), flush=True)
        rows.append(r)
    return rows


def draft_run(model: str, draft: str, batch_sizes: list[int], k: int, prompt_len: int, output_len: int,
              async_spec: bool = False, **engine_kwargs) -> list[dict]:
    """Plain decoding (async) against speculation with the draft model `draft` (synchronous), both peaked to the
    identity chain; per batch size a JSON line with the tokens/s, the seconds of a draft call (the catch-up prefill
    and k greedy decode steps of the draft, synchronised) and of the rest of a speculative step (the verify step
    and the host's work), and the acceptance. `async_spec`: then the draft model under async scheduling too
    (`spec_async_*` keys)."""
    rng = np.random.default_rng(0)
    largest = max(batch_sizes)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine_kwargs.update(load_format="dummy", max_num_seqs=max(largest, 8), enable_prefix_caching=False)
    plain = LLM(model, **engine_kwargs)
    peak_greedy(plain.engine.runner.model, identity=True)
    vocab = plain.engine.vocab_size
    prompts = [rng.integers(1, vocab, prompt_len).tolist() for _ in range(largest)]
    timed(plain, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))          # warm-up
    def identity_chain(prompt):
        return [prompt[-1]] * output_len        # the identity chain's greedy output

    rows = []
    for b in batch_sizes:
        elapsed, outs = timed(plain, prompts[:b], params)
        if any(o != identity_chain(p) for p, o in zip(prompts[:b], outs)):
            raise RuntimeError(f"batch {b}: a greedy output left the identity chain")
        rows.append({"batch": b, "plain_async_tok_s": b * output_len / elapsed})
    release_engine(plain)
    del plain
    speculative = {"method": "draft_model", "model": draft, "num_speculative_tokens": k,
                   "disable_by_batch_size": max(largest, 1)}
    spec = LLM(model, **engine_kwargs, speculative_config=speculative, async_scheduling=False)
    proposer = spec.engine.scheduler.proposer
    peak_greedy(spec.engine.runner.model, identity=True)
    peak_greedy(proposer.runner.model, identity=True)
    propose_batch, draft_time = proposer.propose_batch, [0.0, 0]

    def timed_propose(wanted):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        start = time.perf_counter()
        out = propose_batch(wanted)
        sync()
        draft_time[0] += time.perf_counter() - start
        draft_time[1] += 1
        return out

    proposer.propose_batch = timed_propose
    timed(spec, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    for r in rows:
        draft_time[:] = [0.0, 0]
        elapsed, run = spec_timed(spec, prompts[:r["batch"]], params, identity_chain)
        steps = run["steps"]
        r.update(run, spec_tok_s=run.pop("tok_s"), draft_calls=draft_time[1],
                 draft_call_ms=1e3 * draft_time[0] / max(draft_time[1], 1),
                 step_without_draft_ms=1e3 * (elapsed - draft_time[0]) / max(steps, 1))
        r["speedup_vs_async"] = r["spec_tok_s"] / r["plain_async_tok_s"]
        if not async_spec:
            print(json.dumps(r), flush=True)
    del proposer.propose_batch          # the timing wrapper and this frame hold the draft runner: drop both first
    del proposer, propose_batch
    release_engine(spec)
    del spec
    if async_spec:
        spec = LLM(model, **engine_kwargs, speculative_config=speculative, async_scheduling=True)
        peak_greedy(spec.engine.runner.model, identity=True)
        peak_greedy(spec.engine.scheduler.proposer.runner.model, identity=True)
        timed(spec, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))
        for r in rows:
            elapsed, run = spec_timed(spec, prompts[:r["batch"]], params, identity_chain)
            r.update({f"spec_async_{key}": value for key, value in run.items()},
                     spec_async_step_ms=1e3 * elapsed / max(run["steps"], 1))
            r["spec_async_speedup_vs_async"] = r["spec_async_tok_s"] / r["plain_async_tok_s"]
            print(json.dumps(r), flush=True)
        release_engine(spec)
    return rows


def spec_runs(spec, plain_rows: list[dict], buckets: bool, prompts, recorded, params, k: int,
              acceptance_length: float, vocab: int, profile: int) -> list[dict]:
    """On one speculative engine, per batch size: plain decoding without proposals (synchronous), then speculation
    with `ReplayProposer`; then the profiles. Returns the rows, each `plain_rows`' row with these figures."""
    sched = spec.engine.scheduler
    prompt_len, output_len = len(prompts[0]), params.max_tokens
    timed(spec, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    rows = []
    for plain in plain_rows:
        r = dict(plain, verify_buckets=buckets)
        b = r["batch"]
        sched.proposer = None
        elapsed, outs = timed(spec, prompts[:b], params)
        r["plain_sync_tok_s"] = b * output_len / elapsed
        sched.proposer = ReplayProposer(recorded, k, acceptance_length - 1, vocab, prompt_len)
        _, run = spec_timed(spec, prompts[:b], params, lambda p: recorded[tuple(p)][len(p):])
        r.update(run, spec_tok_s=run.pop("tok_s"))
        r["speedup_vs_async"] = r["spec_tok_s"] / r["plain_async_tok_s"]
        # how a verify step of b requests with k proposals each runs, and the plain decode step beside it
        dispatcher = spec.engine.runner.dispatcher
        for key, (mode, desc) in (("verify_graph", dispatcher.dispatch(b * (k + 1), b, False, None, k + 1)),
                                  ("decode_graph", dispatcher.dispatch(b, b, True))):
            r[key] = f"{mode.name} {desc.num_tokens} tokens, {desc.padded_num_reqs(b)} request rows"
        print(json.dumps(r), flush=True)
        rows.append(r)
    if profile:
        b = plain_rows[0]["batch"]
        for name, proposer in (("plain decoding, synchronous", None),
                               (f"speculation, k={k}, acceptance length {acceptance_length}, verify buckets "
                                f"{'on' if buckets else 'off'}",
                                ReplayProposer(recorded, k, acceptance_length - 1, vocab, prompt_len))):
            sched.proposer = proposer
            # past the prefill step and the first decode, whose host work differs
            steps = profile_workload(spec, prompts[:b], params, profile, skip_steps=2)
            print(f"{name}, batch {b} (per engine step):\n{steps.table()}", flush=True)
    sched.proposer = None
    return rows


if __name__ == "__main__":
    main()
