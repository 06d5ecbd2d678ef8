print("rlmath quickstart: being written")
