"""The methods' own command groups (``moetool comigs|gem|hybrid|embedding …``), named by the registry
(:data:`moetool.registry.METHODS`); like every command here they call the API and the method's modules, and print."""
