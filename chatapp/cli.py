"""Command-line entry point (filled in by the CLI work)."""


def main() -> None:
    print("chatapp")
