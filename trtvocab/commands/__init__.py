"""The command-line programs and what only they need: the typer app, generate, compare, quantize, hidden, plan."""
