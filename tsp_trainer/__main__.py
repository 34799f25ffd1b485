from tsp_trainer.cli import main

main()
