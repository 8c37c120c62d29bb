"""piper-sim: programmable distributed training, simulator first."""

__version__ = "0.1.0"
