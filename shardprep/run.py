"""`python -m shardprep.run DIR ...`, the module torchrun starts: the same options as `shardprep run`."""

from .cli.run import main

if __name__ == "__main__":
    main()
