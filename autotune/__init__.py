"""autotune: find, prove and hand over the fastest launch configuration of a speculative-decoding LLM server."""
from pathlib import Path

__version__ = "0.1.0"

# Data folders live beside the package (the design's top-level layout); installs are editable.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
