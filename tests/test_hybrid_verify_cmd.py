"""`modelpar verify` on a user model (``module:factory``): PASS, FAIL and bad input.

The factories (what a user writes) are in `tests/helpers/user_nets.py`; the command imports them by name.
The command runs in this process (`modelpar.cli.main`, what ``python -m modelpar`` calls) and starts
real torchrun ranks, whose output the captured file descriptors hold; ``python -m modelpar verify``
as a separate process is `tests/test_user_models.py`'s (each such process imports torch: ~3-4 s CPU).
"""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from modelpar.cli.verify import verify_main

HERE = Path(__file__).resolve().parent


def _verify(monkeypatch, capfd, *args):
    """``modelpar verify ARGS``: exit code and captured output (``returncode`` / ``stdout`` / ``stderr``);
    the ranks import ``helpers.user_nets`` from ``tests/`` as this process does."""
    from modelpar.cli import main

    monkeypatch.setenv("PYTHONPATH", f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    capfd.readouterr()
    rc = main(["verify", *args])
    out = capfd.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_user_model_pipeline_passes(monkeypatch, capfd):
    p = _verify(monkeypatch, capfd, "--model", "helpers.user_nets:make_user_net", "--plan",
                '{"pp": 2, "pp_schedule": "interleaved1f1b", "virtual_stages": 2, "n_microbatches": 4}',
                "--steps", "4")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "UserNet from helpers.user_nets:make_user_net" in p.stdout and "\nPASS" in p.stdout
    assert "largest parameter difference" in p.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wrong_loss_scale_fails_under_ddp(monkeypatch, capfd):
    p = _verify(monkeypatch, capfd, "--model", "helpers.user_nets:make_mislabelled_loss", "--strategy", "ddp", "--nproc", "2",
                "--steps", "3", "--optimizer", "sgd", "--lr", "0.01")
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "\nFAIL:" in p.stdout and "beyond tolerance" in p.stdout


def test_bad_model_and_plan_exit_2(capsys):
    assert verify_main(["--model", "no_such_module:f", "--strategy", "ddp"]) == 2
    assert "cannot load f from module no_such_module" in capsys.readouterr().err
    assert verify_main(["--model", "gpt-nano", "--plan", '{"pp": 2, "n_microbatches": 3}']) == 2
    assert "not divisible by n_microbatches=3" in capsys.readouterr().err


def test_bf16_is_refused_before_launch(capsys):
    """Before: ``verify --precision bf16`` launched the ranks and compared bf16 compute with one fp32
    process at fp32 tolerances: FAIL every time (loss 5e-5 relative off at step 1 under fsdp2)."""
    assert verify_main(["--model", "gpt-nano", "--strategy", "fsdp", "--nproc", "2", "--precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "--precision bf16: verify compares the layout with one fp32 process" in err and "--precision fp32" in err
    assert verify_main(["--model", "gpt-nano", "--plan", '{"dp_shard": 2, "precision": "bf16"}']) == 2
    assert "(precision='bf16')" in capsys.readouterr().err


def test_one_process_plan_runs_in_process(capsys):
    assert verify_main(["--model", "mlp-small", "--plan", "{}", "--steps", "2"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_many_nodes_resolve_once_and_print_the_launch_line(tmp_path, capsys, monkeypatch):
    """Issue 13 item 1: `verify --nnodes N --gpus-per-node G` resolves the plan on N x G ranks once,
    writes it beside the options into a folder under the current directory (a filesystem every node
    sees) and prints the torchrun / srun line instead of launching; the topology is checked."""
    from modelpar.plan_file import read_plan_file

    monkeypatch.chdir(tmp_path)
    assert verify_main(["--model", "gpt-nano", "--nnodes", "2", "--gpus-per-node", "2", "--dp-shard", "2",
                        "--tp", "2"]) == 0
    out = capsys.readouterr().out
    (d,) = list(tmp_path.glob("modelpar-verify-*"))
    assert "torchrun --nnodes 2 --nproc-per-node 2" in out and f"--run-dir {d}" in out and "srun" in out
    plan = read_plan_file(d / "plan.json").plan
    assert (plan.dp_shard, plan.tp, plan.world_size) == (2, 2, 4)
    assert verify_main(["--model", "gpt-nano", "--nnodes", "2", "--gpus-per-node", "2", "--nproc", "3"]) == 2
    assert "--nproc 3 disagrees with --nnodes 2 x --gpus-per-node 2 = 4" in capsys.readouterr().err
