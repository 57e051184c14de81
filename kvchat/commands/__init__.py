"""What the ``kvchat`` commands do; ``kvchat/cli.py`` holds their click definitions and
argument checks, these modules the work (one per command family)."""
