"""Engines wsync ships: the synthetic tensor engine, the reference causal-LM engine and its generation service."""
