"""Speculative decoding against plain decoding at a set mean acceptance length, on a bundled config with random
weights (GPU; not a test).

A first pass records the target's own greedy continuation of every prompt with plain decoding; the timed spec run
then proposes from that recording through `ReplayProposer` (a proposer of this bench only, never of the package),
which corrupts one proposed token a step so that on average `--acceptance-length - 1` proposals are accepted: the
verify step's cost is measured at a known acceptance, independent of how well n-grams would guess. Greedy outputs
must match the recording token for token (checked). Per batch size: plain decoding with async scheduling (the
engine's default on CUDA), plain decoding synchronous (what speculation gives up), and speculation.

    PYTHONPATH=. python benches/spec_decode.py --model llama-3.1-8b --batch-sizes 1 8 32 -k 4 --acceptance-length 3.0
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np
import torch

from ember import LLM, SamplingParams
from ember.bench.commands import release_engine


class ReplayProposer:
    """Proposes the recorded continuation of the request whose prompt starts a sequence, with the token after the
    first `m` proposals replaced by a wrong one, m drawn so that its mean is `mean_accepted`."""

    def __init__(self, recorded: dict[tuple[int, ...], list[int]], k: int, mean_accepted: float, vocab: int,
                 key_len: int, seed: int = 0):
        self.recorded, self.k, self.mean, self.vocab, self.key_len = recorded, k, mean_accepted, vocab, key_len
        self.rng = random.Random(seed)

    def propose(self, token_ids: np.ndarray, max_len: int) -> np.ndarray:
        seq = self.recorded[tuple(token_ids[:self.key_len].tolist())]
        n = token_ids.shape[0]
        out = list(seq[n:n + min(self.k, max_len)])
        lo = int(self.mean)
        m = lo + (self.rng.random() < self.mean - lo)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--acceptance-length", type=float, default=3.0, help="mean tokens a verify step emits")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    largest = max(args.batch_sizes)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    plain = LLM(args.model, load_format="dummy", max_num_seqs=max(largest, 8))
    vocab = plain.engine.vocab_size
    prompts = [rng.integers(1, vocab, args.prompt_len).tolist() for _ in range(largest)]
    timed(plain, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))          # warm-up
    results, recorded = [], {}
    for b in args.batch_sizes:
        elapsed, outs = timed(plain, prompts[:b], params)
        recorded.update({tuple(p[:32]): p + o for p, o in zip(prompts[:b], outs)})
        results.append({"batch": b, "plain_async_tok_s": b * args.output_len / elapsed})
    release_engine(plain)
    del plain
    spec = LLM(args.model, load_format="dummy", max_num_seqs=max(largest, 8),
               speculative_config={"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                                   "disable_by_batch_size": max(largest, 1)})
    sched = spec.engine.scheduler
    ngram = sched.proposer
    timed(spec, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    for r in results:
        b = r["batch"]
        sched.proposer = None
        elapsed, outs = timed(spec, prompts[:b], params)
        r["plain_sync_tok_s"] = b * args.output_len / elapsed
        sched.proposer = ReplayProposer(recorded, args.num_speculative_tokens, args.acceptance_length - 1, vocab, 32)
        s = spec.engine.stats
        before = (s.num_draft_tokens, s.num_accepted_tokens, s.num_verified_requests, s.num_steps)
        elapsed, outs = timed(spec, prompts[:b], params)
        same = all(recorded[tuple(p[:32])][len(p):] == o for p, o in zip(prompts[:b], outs))
        verified = s.num_verified_requests - before[2]
        r.update(spec_tok_s=b * args.output_len / elapsed, greedy_tokens_match=same,
                 acceptance_rate=(s.num_accepted_tokens - before[1]) / max(s.num_draft_tokens - before[0], 1),
                 mean_acceptance_length=1 + (s.num_accepted_tokens - before[1]) / max(verified, 1),
                 steps=s.num_steps - before[3])
        r["speedup_vs_async"] = r["spec_tok_s"] / r["plain_async_tok_s"]
        print(json.dumps(r), flush=True)
    sched.proposer = ngram


if __name__ == "__main__":
    main()
