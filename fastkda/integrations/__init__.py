"""fastkda inside other libraries' models (``fastkda.integrations.transformers``)."""
