"""GPU check: MFU, predicted vs measured memory and step time, placement parity.

Needs only torch and modelpar's library modules (models, plan, parallel, planner; not the CLI's
dependencies). On a machine with a CUDA GPU it prints, for a GPT of about 1B parameters
(``gpt-1b``, 0.93B) trained in bf16 (autocast, fp32 master weights, fused-attention SDPA, AdamW) on
one GPU:

1. training MFU = model FLOPs per step (the planner's profile: forward + backward, each counted
   once; PaLM App. B) / (median step time x dense bf16 peak). Goal: >= 45% of 989 TFLOP/s on an
   H100 / H200;
2. predicted (`planner.memory.estimate_memory`, fused AdamW) against measured
   (``torch.cuda.max_memory_allocated`` over step 3) peak memory, and predicted
   (`planner.cost.estimate_step` on the built-in H100/H200 profile) against measured median step time;
3. a placement run: gpt-3m split between ``cpu`` and ``cuda:0`` (fp32, TF32 off) against its
   one-device reference, loss by loss over a few SGD steps.

Without CUDA it says so and exits 0. Run: ``python benchmarks/gpu_check.py [--model gpt-1b]
[--micro-batch 4] [--steps 8] [--compile]``
"""

from __future__ import annotations

import argparse
import sys

import torch

from modelpar.bench.gpu import (DENSE_BF16_PEAK, GOAL_MFU, hardware_for_device, mfu, placement_check,
                                 predict, train_steps)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-1b")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compile", action="store_true", help="torch.compile each block")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device is available (torch.cuda.is_available() is False); nothing to check. "
              "Run it on a machine with an NVIDIA GPU.")
        return 0
    name = torch.cuda.get_device_name(0)
    hw = hardware_for_device(name, torch.cuda.get_device_properties(0).total_memory)
    prof, pmem, pstep = predict(args.model, args.micro_batch, hw)
    flops = prof.train_flops_per_sample * args.micro_batch
    print(f"{args.model}: {prof.num_params / 1e9:.2f}B params, micro-batch {args.micro_batch} x {prof.tokens_per_sample} "
          f"tokens, bf16, on {name} (planner profile {hw.name})")
    run = train_steps(args.model, "cuda:0", micro_batch=args.micro_batch, steps=args.steps,
                      compile_model=args.compile)
    u = mfu(flops, run["median_s"], DENSE_BF16_PEAK)
    print(f"MFU {u:.1%} of {DENSE_BF16_PEAK / 1e12:.0f} TFLOP/s ({flops / run['median_s'] / 1e12:.1f} TFLOP/s achieved; "
          f"goal >= {GOAL_MFU:.0%}): {'met' if u >= GOAL_MFU else 'NOT met'}")
    mem_err = pmem.total / run["peak_bytes"] - 1 if run["peak_bytes"] else float("nan")
    print(f"peak memory: predicted {pmem.total / 2**30:.2f} GiB ({pmem.phase}), measured "
          f"{run['peak_bytes'] / 2**30:.2f} GiB, error {mem_err:+.1%}")
    print(f"step time: predicted {pstep.total * 1e3:.1f} ms, measured median {run['median_s'] * 1e3:.1f} ms "
          f"(steps {', '.join(f'{t * 1e3:.0f}' for t in run['times'])} ms), error {pstep.total / run['median_s'] - 1:+.1%}")
    torch.cuda.empty_cache()
    pc = placement_check(("cpu", "cuda:0"))
    ok = pc["max_rel_diff"] <= 1e-4
    print(f"placement cpu + cuda:0 vs one device: losses {pc['placement']} vs {pc['reference']}, largest relative "
          f"difference {pc['max_rel_diff']:.2e} ({'matches' if ok else 'DOES NOT match'}, tolerance 1e-4)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
