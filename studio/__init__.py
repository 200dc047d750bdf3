"""Studio: QLoRA fine-tuning in the terminal."""
__version__ = "0.1.0"
