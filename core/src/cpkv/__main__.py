"""``python -m cpkv`` (and ``torchrun ... -m cpkv run``) is the ``cpkv`` command."""

from cpkv.cli import main

main()
