from symbiosis.cli import main

main()
