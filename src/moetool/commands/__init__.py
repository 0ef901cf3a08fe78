"""CLI command groups of the methods (``moetool comigs|embedding|gem|hybrid …``).

They live outside ``moetool.methods`` so that ``moetool --help`` and every other command start without importing
torch and the method packages: each command imports its method inside its body.
"""
