"""`autotune bundle`: the wheels an engine release needs on an air-gapped machine, given what that machine has.

target.py describes the machine (Python, platform, its `pip freeze`); index.py reads PyPI (release files, and
each wheel's own METADATA by HTTP range requests); resolve.py picks the engine release that matches the target's
torch and CUDA and the wheels the target lacks; download.py fetches and checks them; split.py cuts the wheels
into parts a transfer can carry; script.py writes install.sh; command.py is the CLI command.
"""
