from symbiosis.cli import run

run()
