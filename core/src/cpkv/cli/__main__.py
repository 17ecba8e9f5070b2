"""``python -m cpkv.cli`` is the ``cpkv`` command."""

from cpkv.cli import main

main()
