PRICES = {"apple": 0.5, "pear": 0.75}


def total(order: dict[str, int]) -> float:
    return sum(PRICES[item] * count for item, count in order.items())
