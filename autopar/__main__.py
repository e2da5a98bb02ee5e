from autopar.commands.main import exit_process, main

# Guarded: rehearse starts its ranks as spawned processes, which import this module again.
if __name__ == "__main__":
    exit_process(main())
