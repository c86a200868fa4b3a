"""Model architectures: one file per family, built from tidal.layers."""
