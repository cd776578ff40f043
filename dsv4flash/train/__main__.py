"""`python -m dsv4flash.train +recipe=NAME`."""

from dsv4flash.train.main import main

main()
