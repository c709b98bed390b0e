from hfscale.cli import main

main(prog_name="hfscale")
