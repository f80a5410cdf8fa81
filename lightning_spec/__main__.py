from lightning_spec.cli import main

main()
