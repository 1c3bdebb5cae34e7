"""Selective checkpointing on a model without attention cores modelpar recognises (a Hugging Face
Llama): refused before launch by `train` (it was refused on the ranks ~12 s after launch), by
`estimate` of that layout (which priced it: "fits", recompute 0.0 ms) and by `plan` (whose message
named ac_every, a flag the user had not given), each naming the flag and the way out."""

import json

import pytest

from helpers.hf_tiny import TINY, cli_args
from helpers.pure_fixtures import requires

pytestmark = requires("transformers")

WAY_OUT = r"--activation-checkpointing selective recomputes each block's attention core.*use full or every-k"


def test_train_refuses_selective_before_launch(tmp_path):
    from modelpar.cli.train import main as train_main

    spec, cfg = TINY["llama"]
    argv = ["--model", spec, "--model-config", json.dumps({**cfg, "vocab_size": 256}), "--strategy", "fsdp", "--nproc", "2", "--activation-checkpointing", "selective",
            "--steps", "1", "--seq-len", "16", "--out-dir", str(tmp_path / "runs")]
    with pytest.raises(ValueError, match=r"activation_checkpointing='selective' recomputes each block's attention "
                                         r"core, but block .* has none.* A Hugging Face block computes attention in "
                                         r"a function, not a module: use 'full' or 'every-k'$"):
        train_main(argv)    # (a fresh user's trial: "Mark the module that computes softmax(QK^T)V" cannot be done)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_planner_commands_refuse_selective_by_the_flag(command, capsys):
    from modelpar.cli import main

    extra = ["--strategy", "fsdp"] if command == "estimate" else []
    rc = main([command, *cli_args("llama"), "--nproc", "2", "--hardware", "cpu", "--seq-len", "16",
               "--activation-checkpointing", "selective", *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    import re
    assert re.search(WAY_OUT, err) and "ac_every" not in err, err


def test_verify_refuses_selective_before_launch(monkeypatch):
    from modelpar.cli import verify

    monkeypatch.setattr("modelpar.launch.run_command", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match=r"activation_checkpointing='selective' recomputes .* has none"):
        verify.main([*cli_args("llama"), "--strategy", "ddp", "--nproc", "2", "--seq-len", "16", "--steps", "1",
                     "--activation-checkpointing", "selective"])
