"""The engine: the model and what drives it over the memory pools."""
