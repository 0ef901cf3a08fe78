"""Training stages on assembled checkpoints (router tuning). ``assemble`` never imports ``train``."""
