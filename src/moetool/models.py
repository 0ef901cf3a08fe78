"""Importing this module registers moetool's own model classes with transformers' Auto classes.

    import moetool.models  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained("out/gem")   # a moetool_gem / moetool_comigs / … checkpoint

Standard outputs (Mixtral, Qwen2-MoE, Qwen3-MoE, baked CoMiGS users) need nothing: they are plain transformers models.
"""

from moetool.methods import register_model_classes

register_model_classes()
