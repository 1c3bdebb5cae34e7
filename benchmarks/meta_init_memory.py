"""Per-rank peak RSS (MiB) after building, FSDP-sharding and (with meta_init) materialising a Hugging Face
GPT-2 from config (85.3M parameters, 325 MiB fp32; ``hf``, the default) or the built-in ``gpt-100m``
(85.9M, the same widths; ``gpt``) on 2 CPU ranks, with meta_init off (0) and on (1).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 \
        benchmarks/meta_init_memory.py 0|1 [hf|gpt]
"""
import json, resource, sys
from pathlib import Path
import torch, torch.distributed as dist
from modelpar.launch import exit_rank
from modelpar.parallel.mesh import init_distributed, build_mesh
from modelpar.parallel.compose import parallelize
from modelpar.plan import plan_for_strategy
from modelpar.train.config import TrainConfig
from modelpar.train.task import build_task, lm_loss
from modelpar.train.materialise import materialise
meta = sys.argv[1] == "1"
rank, world = init_distributed(120)
torch.set_num_threads(1)
if sys.argv[2:] == ["gpt"]:
    cfg = TrainConfig(model="gpt-100m", meta_init=meta, seq_len=32)
else:
    mc = {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 256, "n_positions": 64, "bos_token_id": 0,
          "eos_token_id": 0}
    cfg = TrainConfig(model="hf:gpt2", model_config=mc, meta_init=meta, seq_len=32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
task = build_task(cfg, load_data=False)
plan = plan_for_strategy("fsdp", world)
dev = torch.device("cpu")
pm = parallelize(task.model, plan, build_mesh(plan, dev), loss_fn=lm_loss, device=dev)
if meta:
    materialise(pm.modules, cfg, dev)
local = sum(p.to_local().numel() for p in pm.parameters()) * 4
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = [None] * world
dist.all_gather_object(out, (rank, before / 1024, peak / 1024, local / 2**20))
if rank == 0:
    full = sum(p.numel() for p in task.model.parameters())
    print(f"meta_init={meta}: model {full/1e6:.1f}M params ({full*4/2**20:.0f} MiB fp32); per rank (rank, RSS before MiB, peak RSS MiB, local shard MiB): {out}")
exit_rank(0)
