"""``python -m replicas``: run one replica process (what ``fairstream replica`` runs)."""

from replicas.cli import main

if __name__ == "__main__":
    main()
