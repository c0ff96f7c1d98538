"""Command-line tools: the ``wsync`` CLI and the demo."""
