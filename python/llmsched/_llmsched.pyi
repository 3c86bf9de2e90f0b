"""Type stubs for the native module. Kept in sync with rust/py/ by `make lint` (stubtest)."""

import numpy as np
import numpy.typing as npt

__version__: str

def xxh3_block_hashes(
    tokens: npt.NDArray[np.integer], block_size: int, chain_seed: int
) -> npt.NDArray[np.uint64]: ...
def namespace_seed(
    seed: int, model: str | None = None, lora: str | None = None, cache_salt: str | None = None
) -> int: ...
