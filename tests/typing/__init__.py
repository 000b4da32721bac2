"""SDK usage snippets that ``make typecheck`` runs through mypy --strict (never imported
by pytest): how the client's types read to the code that uses it."""
