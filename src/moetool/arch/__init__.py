"""Input dense families and output MoE architectures, described as data."""

from moetool.arch.outputs import OUTPUT_ARCHS, MoEArch, Verdict, select_output_arch

__all__ = ["OUTPUT_ARCHS", "MoEArch", "Verdict", "select_output_arch"]
