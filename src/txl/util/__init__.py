"""Utilities every layer may use: crash-safe files and folder locks (``fileio``), model/run folder resolution
(``folders``), the process group (``distributed``), metrics.jsonl (``metrics``) and plots (``plot``). Imports
nothing of txl."""
