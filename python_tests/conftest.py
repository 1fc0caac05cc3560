import os
import sys

# Tests import helpers as top-level modules (backends, sim.build).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
