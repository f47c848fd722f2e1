"""The command line: ``switchboard serve|migrate|openapi|asyncapi`` and the operator commands (``sessions``, ``tail``,
``input``, ...). ``python -m switchboard.cli`` is the same as the ``switchboard`` command."""
