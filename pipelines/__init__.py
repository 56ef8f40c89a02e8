"""The KFP training pipeline (``trace_training``), its local run (``local``), its pinned
settings (``settings``) and the compiled IR YAML under ``compiled/``."""
