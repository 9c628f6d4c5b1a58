"""kvlab: a research workbook on the KV-cache bill of disaggregated LLM inference.

How many bytes a prefill GPU hands to a decode GPU, how long that takes on each link, and whether it
hides under prefill. Import the submodules you need (``from kvlab import results, plots``); importing
the package itself stays cheap on purpose (no torch, no pandas) so ``kvlab --help`` answers at once.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("kvlab")
except _metadata.PackageNotFoundError:  # running from a source tree that was never pip-installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
