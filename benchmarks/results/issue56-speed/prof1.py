"""cProfile of loop1's measured loop (a smaller one) at ROOT: python prof1.py ROOT MODEL N"""
import cProfile, pstats, sys, runpy, io
root, model, n = sys.argv[1], sys.argv[2], sys.argv[3]
sys.argv = ["loop1.py", root, model, "fp32", "-", n]
pr = cProfile.Profile()
pr.enable()
import os
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "loop1.py"), run_name="__main__")
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue()[:6000])
