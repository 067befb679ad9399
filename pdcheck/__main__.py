from pdcheck.cli import main

if __name__ == "__main__":  # the forkserver re-imports __main__ in children
    main()
