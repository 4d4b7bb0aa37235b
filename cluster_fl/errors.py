"""Errors meant for the user: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input a user can fix (a config value, a missing file, a corrupt corpus row)."""
