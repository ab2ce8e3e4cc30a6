"""A stand-in for the user's web browser (``BROWSER``): appends the URL it is asked to open to a file.

Usage: ``python tests/record_url.py FILE URL``; the tests then open the URL in headless Chromium.
"""
import sys

with open(sys.argv[1], "a") as out:
    out.write(sys.argv[2] + "\n")
