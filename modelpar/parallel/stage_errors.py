"""One stage of a pipeline cut run alone before launch (`modelpar.parallel.stages.check_chain`), with the
model's own failure turned into a refusal that says what a stage needs."""

from __future__ import annotations

import torch.nn as nn


def run_stage(stage: nn.Module, x, index: int, blocks: list[str], model: nn.Module):
    """``stage(x)``, the stage released after (`modelpar.parallel.stages.release`).

    ``blocks``: the paths of the blocks the stage holds (first and last are named in the message).

    Raises:
        ValueError: modelpar's own stage refusal unchanged; any other error of the model's forward run as
            a stage (Swin's embeddings return ``(hidden states, dimensions)``, which the stand-in of a later
            stage does not: 'not enough values to unpack') as one line naming the model, the stage, its
            blocks, the error and the way out, instead of the bare error before launch.
    """
    from modelpar.parallel.stages import release

    try:
        return stage(x)
    except Exception as e:  # noqa: BLE001 - any failure of the model's forward in a stage is refused
        if isinstance(e, ValueError) and str(e).startswith("pipeline stage"):
            raise
        held = f"{blocks[0]}..{blocks[-1]}" if blocks else "no blocks"
        raise ValueError(f"{type(getattr(model, 'hf', model)).__name__}: its forward fails as pipeline stage {index} ({held}) "
                         f"({type(e).__name__}: {e}): a stage runs the model's own forward with the modules of "
                         f"other stages replaced by stand-ins that hand on one tensor, and this forward passes "
                         f"something else between them (e.g. a tuple, as Swin's embeddings' (hidden states, "
                         f"dimensions)); name other blocks with --blocks PATH, or use a layout without a "
                         f"pipeline (--strategy ddp, fsdp or tp)") from e
    finally:
        release(stage)
