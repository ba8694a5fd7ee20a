"""``python -m octopipe.execute``: the same as the ``octopipe`` command."""

from octopipe.execute.cli import entry

if __name__ == "__main__":
    entry()
