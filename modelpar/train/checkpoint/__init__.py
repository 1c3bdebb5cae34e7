"""Distributed checkpoints: save on any layout, resume on any other, export the plain model.

Four layers, one module each, each using only the ones above it:

- `storage`: format and storage. What a ``step-NNNNNNNN`` folder holds (DCP files, per-rank RNG,
  ``modelpar.json`` with a file manifest, the ``COMPLETE`` marker), finding and validating folders,
  the atomic (optionally async) writer with keep-last pruning, and reading files back.
- `state`: state adaptation. A rank's modules and optimizer under any plan <-> the canonical state of
  the plain model (original names, global shapes; TP's permuted q|k|v in the original order; each
  tie once), the model check, and the collective `Checkpointer.save` / `load_checkpoint`.
- `resume`: the training loop's policy (`TrainCheckpoints`): which checkpoint ``--resume`` means, what
  must match between the saved run and this one, RNG on a new layout, when to save and what run
  metadata to record.
- `export`: the model of a checkpoint as one safetensors file or a Hugging Face folder.

The names below are the public API (``from modelpar.train.checkpoint import ...``); docs/checkpoints.md
describes the files and the flags.
"""

from modelpar.train.checkpoint.storage import (CheckpointError, CheckpointWriter, latest_checkpoint,
                                               list_checkpoints, read_checkpoint_meta, resolve_checkpoint,
                                               single_process_dcp, step_dir)
from modelpar.train.checkpoint.state import Checkpointer, checkpoint_module, get_train_state, load_checkpoint
from modelpar.train.checkpoint.resume import TrainCheckpoints
from modelpar.train.checkpoint.export import (checkpoint_model_spec, export_checkpoint, export_hf_folder,
                                              read_model_state)

__all__ = ["CheckpointError", "CheckpointWriter", "Checkpointer", "TrainCheckpoints", "checkpoint_model_spec",
           "checkpoint_module", "export_checkpoint", "export_hf_folder", "get_train_state", "latest_checkpoint",
           "list_checkpoints", "load_checkpoint", "read_checkpoint_meta", "read_model_state", "resolve_checkpoint",
           "single_process_dcp", "step_dir"]
