"""One module per technique (placement, data_parallel, tensor, pipeline, checkpointing) and
`compose.parallelize`, which applies them in a fixed order."""

from modelpar.parallel.compose import ParallelModel, parallelize
from modelpar.parallel.mesh import MeshInfo, build_mesh, get_device, init_distributed

__all__ = ["ParallelModel", "parallelize", "MeshInfo", "build_mesh", "get_device", "init_distributed"]
